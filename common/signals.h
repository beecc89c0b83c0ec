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

#endif /* KC_SIGNALS_H */
