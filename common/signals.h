/*
 * signals.h - how every kvrelay process learns it should stop: SIGINT and SIGTERM run a handler
 * that writes the signal number into a pipe the main thread reads (SIGPIPE is ignored).
 * Not sigwait: libraries start threads before main can block signals (OpenBLAS does, when it
 * loads), so a signal arriving while main is not in sigwait (a second Ctrl-C during shutdown,
 * one during start-up) would take its default action on such a thread and kill the process.
 */
#ifndef KC_SIGNALS_H
#define KC_SIGNALS_H

/* Installs the handlers. Returns 0, or -1 with errno set (the pipe could not be made). */
int kc_signals_init(void);
/* Blocks until SIGINT or SIGTERM arrives (or arrived since kc_signals_init); returns it. */
int kc_signals_wait(void);
/* Waits up to timeout_ms for SIGINT or SIGTERM; returns it, or 0 when none came. */
int kc_signals_wait_ms(int timeout_ms);

/* A node's drain after its first stop signal: polls idle(user) every 100 ms until it answers
 * non-zero (KC_DRAIN_DONE), timeout_s passes (KC_DRAIN_TIMEOUT) or another stop signal arrives
 * (KC_DRAIN_SIGNAL: the operator wants it to stop at once). */
typedef enum kc_drain_end { KC_DRAIN_DONE = 0, KC_DRAIN_TIMEOUT = 1, KC_DRAIN_SIGNAL = 2 } kc_drain_end;
kc_drain_end kc_signals_drain(int (*idle)(void *user), void *user, double timeout_s);

#endif /* KC_SIGNALS_H */
