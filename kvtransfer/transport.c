/*
 * transport.c - the UCX transport of transport.h: one ucp worker owned by one progress thread.
 *
 * How it works: every UCX call is made on the progress thread (or on the creating/destroying
 * thread while that thread is not running), so the worker runs in SERIALIZED mode. The API
 * functions only edit tables under t->lock and wake the thread through an eventfd; the thread
 * progresses the worker with the lock held (UCX callbacks therefore see consistent tables and
 * only record facts), acts on what the callbacks recorded (starts sends, acks, closes failed
 * endpoints, expires reservations), then calls the user's callbacks with the lock released and
 * sleeps on the worker's event fd + the eventfd until the next deadline.
 * Wire: AM id KT_AM_BUNDLE carries a 56-byte header (magic, version, seq, id, size, the
 * reservation's 16-byte token) and the bundle as data; the receiver answers every bundle with an
 * AM KT_AM_ACK (seq, id, status, message) on the reply endpoint, so the sender learns a refusal
 * instead of a silent drop. The token is drawn from getrandom at reserve time and compared in
 * constant time: a bundle with a wrong one is refused and the reservation keeps waiting.
 * RMA (KT_TRANSPORT_MODE_RMA): a reservation's buffer is mapped at reserve time and its remote
 * key handed out; the sender's op goes put -> flush -> header (flag KT_WIRE_PUT, the part's
 * offset at 32, no data), and the receiver takes the header as "the part is in buf at offset".
 * A reservation may also map two rows regions (kt_transport_map_rows: a decode node's K and V
 * rows of a run of KV blocks); a block-padded part put with its rows goes as three puts (its
 * head into buf, its K and V into the regions, each after the rows parts before it), one flush,
 * then a header with KT_WIRE_PUT and KT_WIRE_PIECE whose size is the head's. Put parts are read
 * only after the last one's header, once every mapping is gone: validating a part the sender
 * can still overwrite would prove nothing; a rows part is then parsed head first, its K and V
 * where they lie in the regions.
 * Pieces (KT_WIRE_PIECE): a block-padded bundle part is sent as three messages, its head, K and
 * V. The receiver takes the head into a buffer, checks it, asks the set's placement hook where K
 * and V go (a run of KV blocks, or a part buffer as for a whole part), and receives them there;
 * a K or V message that comes before the head was placed is held (its rendezvous descriptor or
 * its eager data, the handler returning UCS_INPROGRESS) until it has a place. ucp_mem_map and ucp_rkey_pack are
 * context calls made by the reserving thread under t->lock, which the progress thread holds
 * while it drives the worker, so they never run beside it.
 * What it is not: multi-worker, or tuned for many thousand peers (tables are linked lists: a
 * node has few peers and few reservations in flight).
 * Files: this one (lifecycle, the progress loop and its phases, connections),
 * transport-recv.c, transport-send.c, transport-put.c; what they share: transport-impl.h.
 */
#include "transport-impl.h"

void kt_seterr(char *err, const char *fmt, ...)
{
    if (!err)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, KT_ERR_MAX, fmt, ap);
    va_end(ap);
}

/* Peer and runtime errors the loop cannot return, and trace lines: through the program's log
 * callback, or one line on stderr tagged with the role, the level and the request id. */
void kt_log(const kt_transport *t, kt_log_level level, const char *rid, const char *fmt, ...)
{
    static const char *const names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    char line[KT_ERR_MAX + 64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (rid && !*rid)
        rid = NULL;
    if (t->log)
        t->log(t->log_arg, level, rid, line);
    else
        fprintf(stderr, "[kt %s] %s%s%s%s %s\n", t->name, names[level], rid ? " [" : "",
                rid ? rid : "", rid ? "]" : "", line);
}

/* KT_TRANSPORT_TRACE in the environment: protocol trace lines are logged (KT_TRACE). */
int kt_trace_enabled(void)
{
    static int on = -1;
    if (on < 0)
        on = getenv("KT_TRANSPORT_TRACE") != NULL;
    return on;
}

double kt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The progress thread holds the lock while it progresses, which under a bulk transfer is all
 * the time; a mutex is not fair, so API calls announce themselves and the loop steps aside. */
void kt_api_lock(kt_transport *t)
{
    atomic_fetch_add(&t->api_waiting, 1);
    pthread_mutex_lock(&t->lock);
    atomic_fetch_sub(&t->api_waiting, 1);
}

static void kt_yield_to_api(kt_transport *t)
{
    if (atomic_load(&t->api_waiting) == 0)
        return;
    pthread_mutex_unlock(&t->lock);
    for (int i = 0; i < 1000 && atomic_load(&t->api_waiting) > 0; i++)
        sched_yield();
    pthread_mutex_lock(&t->lock);
}

void kt_wake(kt_transport *t)
{
    uint64_t one = 1;
    ssize_t n = write(t->wake_fd, &one, sizeof one);
    (void)n; /* EAGAIN means a wake-up is already pending */
}

kt_conn *kt_conn_by_ep(kt_transport *t, ucp_ep_h ep)
{
    for (kt_conn *c = t->conns; c; c = c->next)
        if (c->ep == ep)
            return c;
    return NULL;
}

/* 1 while any of q[0, n) is in flight. */
int kt_rq_busy(const kt_rq *q, int n)
{
    for (int i = 0; i < n; i++)
        if (q[i].req)
            return 1;
    return 0;
}

/* Frees the requests of q[0, n) that completed, setting bit i of *finished for each that did
 * so successfully; returns the first failure's status (UCS_OK: none). */
ucs_status_t kt_rq_reap(kt_rq *q, int n, unsigned *finished)
{
    ucs_status_t first = UCS_OK;
    for (int i = 0; i < n; i++) {
        if (!q[i].req || q[i].pending)
            continue;
        ucp_request_free(q[i].req);
        q[i].req = NULL;
        if (q[i].status == UCS_OK)
            *finished |= 1u << i;
        else if (first == UCS_OK)
            first = q[i].status;
    }
    return first;
}

static void kt_on_conn_request(ucp_conn_request_h req, void *arg)
{
    kt_transport *t = arg;
    kt_conn_req *cr = calloc(1, sizeof *cr);
    if (!cr || t->stopping) {
        free(cr);
        ucs_status_t st = ucp_listener_reject(t->listener, req);
        if (st != UCS_OK)
            KT_UCS_LOG(t, "ucp_listener_reject", st);
        return;
    }
    cr->req = req;
    cr->next = t->conn_reqs;
    t->conn_reqs = cr;
}

void kt_on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kt_conn *c = arg;
    if (c->failed)
        return;
    c->failed = 1;
    snprintf(c->fail_msg, sizeof c->fail_msg, "peer %s failed: %s", c->peer,
             ucs_status_string(status));
    c->error = status; /* logged when the loop closes it, where it knows what hung on it */
}

void kt_conn_close(kt_transport *t, kt_conn *c)
{
    if (c->closing)
        return;
    /* Detach: the next send to this address creates a new endpoint. */
    for (kt_conn **pp = &t->conns; *pp; pp = &(*pp)->next) {
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    }
    c->closing = 1;
    if (c->error != UCS_OK) { /* a peer that went away between bundles is no failure */
        const char *busy = NULL; /* the request id of a transfer it held, "" for none given */
        for (kt_resv *r = t->resvs; r && !busy; r = r->next)
            busy = r->from == c && !r->done ? r->rid : NULL;
        for (kt_send_op *op = t->ops; op && !busy; op = op->next)
            busy = op->conn == c && !op->done ? op->rid : NULL;
        if (busy)
            kt_log(t, KT_LOG_WARN, busy, "%s", c->fail_msg);
        else
            kt_log(t, KT_LOG_INFO, NULL, "peer %s disconnected (%s); nothing was in flight on it",
                   c->peer, ucs_status_string(c->error));
    }
    if (!c->failed) {
        c->failed = 1;
        snprintf(c->fail_msg, sizeof c->fail_msg, "connection to %s closed", c->peer);
    }
    /* Nothing may reference c once it is freed: unstarted acks, reservations, sends. */
    for (kt_ack **pp = &t->acks; *pp;) {
        kt_ack *a = *pp;
        if (!a->started && a->conn == c) {
            *pp = a->next;
            free(a);
        } else {
            pp = &a->next;
        }
    }
    for (kt_resv *r = t->resvs; r; r = r->next) {
        if (r->from != c)
            continue;
        r->from = NULL;
        if (!r->done) {
            char msg[KT_ERR_MAX];
            snprintf(msg, sizeof msg, "transport: reservation %" PRIu64
                     ": sender failed mid-transfer (%s)", r->id, c->fail_msg);
            kt_resv_finish(r, -1, 0, msg);
        }
        kt_rx_cancel(t, r);
    }
    for (kt_send_op *op = t->ops; op; op = op->next) {
        if (op->conn != c)
            continue;
        op->conn = NULL;
        op->conn_failed = 1;
        kt_op_fail(op, "transport: send of bundle %" PRIu64 " to %s failed: %s", op->id,
                   op->peer, c->fail_msg);
    }
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t sp = ucp_ep_close_nbx(c->ep, &p);
    if (UCS_PTR_IS_ERR(sp))
        KT_UCS_LOG(t, "ucp_ep_close_nbx(FORCE)", UCS_PTR_STATUS(sp));
    c->close_req = UCS_PTR_IS_PTR(sp) ? sp : NULL;
    c->next = t->closing;
    t->closing = c;
}

static void kt_accept(kt_transport *t, ucp_conn_request_h req)
{
    kt_conn *c = calloc(1, sizeof *c);
    if (!c) {
        kt_log(t, KT_LOG_ERROR, NULL, "out of memory accepting a connection; rejected");
        ucp_listener_reject(t->listener, req);
        return;
    }
    c->t = t;
    snprintf(c->peer, sizeof c->peer, "accepted #%" PRIu64, ++t->n_accepted);
    ucp_conn_request_attr_t qa = {.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR};
    if (ucp_conn_request_query(req, &qa) == UCS_OK && qa.client_address.ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)&qa.client_address;
        char ip[INET_ADDRSTRLEN] = "?";
        inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
        snprintf(c->peer, sizeof c->peer, "%s:%u (accepted)", ip, ntohs(in->sin_port));
    }
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .conn_request = req,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = kt_on_ep_error, .arg = c},
    };
    ucs_status_t st = ucp_ep_create(t->worker, &ep, &c->ep);
    if (st != UCS_OK) {
        KT_UCS_LOG(t, "ucp_ep_create(conn_request)", st);
        free(c);
        return;
    }
    c->next = t->conns;
    t->conns = c;
}

/* Accepts the connection requests the listener queued, or rejects them while stopping. */
static void kt_step_conn_reqs(kt_transport *t)
{
    while (t->conn_reqs) {
        kt_conn_req *cr = t->conn_reqs;
        t->conn_reqs = cr->next;
        if (t->stopping)
            ucp_listener_reject(t->listener, cr->req);
        else
            kt_accept(t, cr->req);
        free(cr);
    }
}

/* Closes the connections that failed (all of them when stopping): what hangs on them fails. */
static void kt_step_conns(kt_transport *t)
{
    for (kt_conn *c = t->conns, *nx; c; c = nx) {
        nx = c->next;
        if (c->failed || t->stopping)
            kt_conn_close(t, c);
    }
}

/* Frees the closed endpoints once UCX is done with them. */
static void kt_step_closing(kt_transport *t)
{
    for (kt_conn **pp = &t->closing; *pp;) {
        kt_conn *c = *pp;
        if (c->close_req && ucp_request_check_status(c->close_req) == UCS_INPROGRESS) {
            pp = &c->next;
            continue;
        }
        if (c->close_req)
            ucp_request_free(c->close_req);
        *pp = c->next;
        free(c);
    }
}

/* One pass over every table, phase by phase; returns the earliest deadline still ahead (or
 * now + 1 s). */
static double kt_step(kt_transport *t)
{
    const double now = kt_now();
    double next = now + 1.0;
    kt_step_conn_reqs(t);
    for (kt_resv *r = t->resvs; r; r = r->next) {
        const double d = kt_resv_step(t, r, now);
        next = d < next ? d : next;
    }
    for (kt_send_op *op = t->ops; op; op = op->next) {
        const double d = op->done ? INFINITY : kt_op_step(t, op, now);
        next = d < next ? d : next;
    }
    kt_step_conns(t);
    kt_step_acks(t);
    kt_step_closing(t);
    return next;
}

/* Calls the callbacks of finished reservations and sends without the lock, then frees them. */
static int kt_deliver(kt_transport *t)
{
    int n = 0;
    for (kt_resv *r = t->resvs; r; r = r->next) {
        if (!r->done || kt_rq_busy(r->rx, KT_PIECES))
            continue;
        kt_resv_unmap(t, r); /* ended otherwise than by its last part: expired, released, failed */
        pthread_mutex_unlock(&t->lock);
        r->cb(r->cb_arg, r->id, r->status, r->bytes, r->msg);
        pthread_mutex_lock(&t->lock);
        r->cb = NULL;
        n++;
    }
    for (kt_send_op *op = t->ops; op; op = op->next) {
        if (!op->done || !op->cb)
            continue;
        pthread_mutex_unlock(&t->lock);
        op->cb(op->cb_arg, op->id, op->status, op->status == 0 ? op->size : 0, op->fail_msg);
        pthread_mutex_lock(&t->lock);
        op->cb = NULL;
        n++;
    }
    for (kt_resv **pp = &t->resvs; *pp;) {
        kt_resv *r = *pp;
        if (r->done && !r->cb) {
            *pp = r->next;
            kt_partbuf_free(r->part);
            kt_partbuf_free(r->head);
            free(r->put_parts);
            free(r);
        } else {
            pp = &r->next;
        }
    }
    for (kt_send_op **pp = &t->ops; *pp;) {
        kt_send_op *op = *pp;
        if (op->done && !op->cb) {
            *pp = op->next;
            for (int i = 0; i < KT_PIECES; i++)
                if (op->rkey[i]) ucp_rkey_destroy(op->rkey[i]);
            free(op);
        } else {
            pp = &op->next;
        }
    }
    if (n)
        pthread_cond_broadcast(&t->cond);
    return n;
}

static void *kt_progress_main(void *arg)
{
    kt_transport *t = arg;
    pthread_mutex_lock(&t->lock);
    for (;;) {
        kt_yield_to_api(t);
        while (ucp_worker_progress(t->worker) != 0) {
            if (atomic_load(&t->api_waiting) > 0)
                break;
        }
        double next = kt_step(t);
        int delivered = kt_deliver(t);
        if (t->stopping && !t->resvs && !t->ops && !t->acks && !t->conns && !t->closing)
            break;
        if (delivered)
            continue;
        /* Anything UCX still has to say before we may sleep? While transfers are in flight, poll
         * for a short while first: the next event (an ack, the next fragment) usually follows
         * within microseconds, and waking from the event fd costs more than that. */
        if (ucp_worker_progress(t->worker) != 0)
            continue;
        if (t->ops || t->acks || t->resvs) {
            double until = kt_now() + KT_SPIN_S;
            int got = 0;
            while (!got && kt_now() < until && atomic_load(&t->api_waiting) == 0)
                got = ucp_worker_progress(t->worker) != 0;
            if (got)
                continue;
        }
        ucs_status_t st = ucp_worker_arm(t->worker);
        if (st == UCS_ERR_BUSY)
            continue;
        if (st != UCS_OK)
            KT_UCS_LOG(t, "ucp_worker_arm", st);
        double wait = next - kt_now();
        int ms = wait <= 0 ? 0 : (int)(wait * 1000.0) + 1;
        if (t->stopping || t->closing)
            ms = ms > 10 ? 10 : ms; /* close requests complete without an event */
        pthread_mutex_unlock(&t->lock);
        struct pollfd fds[2] = {{.fd = t->worker_efd, .events = POLLIN},
                                {.fd = t->wake_fd, .events = POLLIN}};
        int pr = poll(fds, 2, st == UCS_OK ? ms : 1);
        if (pr > 0 && (fds[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t n = read(t->wake_fd, &v, sizeof v);
            (void)n;
        }
        pthread_mutex_lock(&t->lock);
    }
    pthread_mutex_unlock(&t->lock);
    return NULL;
}

int kt_transport_create(const kt_transport_config *cfg, kt_transport **out, char *err)
{
    if (cfg->mode != KT_TRANSPORT_MODE_AM && cfg->mode != KT_TRANSPORT_MODE_RMA) {
        kt_seterr(err, "transport: unknown mode %d", (int)cfg->mode);
        return -1;
    }
    kt_transport *t = calloc(1, sizeof *t);
    if (!t) {
        kt_seterr(err, "transport: out of memory");
        return -1;
    }
    snprintf(t->name, sizeof t->name, "%s", cfg->name ? cfg->name : "transport");
    t->log = cfg->log;
    t->log_arg = cfg->log_arg;
    t->rma = cfg->mode == KT_TRANSPORT_MODE_RMA;
    t->worker_efd = -1;
    t->next_seq = 1;
    pthread_mutex_init(&t->lock, NULL);
    pthread_cond_init(&t->cond, NULL);
    t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t->wake_fd < 0) {
        kt_seterr(err, "transport: eventfd: %s", strerror(errno));
        goto err_free;
    }

    ucp_config_t *uc = NULL;
    /* A decode node restarted at the same address must be able to listen again while the
     * dead process's sockets linger; UCX's default is not to reuse. ucp_config_modify does not
     * reach this tcp_cm setting in 1.13 ("invalid configuration"), so it goes through the
     * environment, without overriding a value the user set. */
    setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
    KT_UCS_CHECK(ucp_config_read(NULL, NULL, &uc), err, err_fd);
    ucp_params_t up = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (t->rma ? UCP_FEATURE_RMA : 0),
        .name = t->name,
    };
    ucs_status_t st = ucp_init(&up, uc, &t->ctx);
    ucp_config_release(uc);
    KT_UCS_CHECK(st, err, err_fd);

    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    KT_UCS_CHECK(ucp_worker_create(t->ctx, &wp, &t->worker), err, err_ctx);
    KT_UCS_CHECK(ucp_worker_get_efd(t->worker, &t->worker_efd), err, err_worker);

    /* Eager bundle data stays valid past the handler when it returns UCS_INPROGRESS (a piece
     * held until its part is placed). */
    ucp_am_handler_param_t hb = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = KT_AM_BUNDLE, .cb = kt_on_bundle, .arg = t, .flags = UCP_AM_FLAG_PERSISTENT_DATA,
    };
    KT_UCS_CHECK(ucp_worker_set_am_recv_handler(t->worker, &hb), err, err_worker);
    ucp_am_handler_param_t ha = hb;
    ha.flags = 0;
    ha.id = KT_AM_ACK;
    ha.cb = kt_on_ack;
    KT_UCS_CHECK(ucp_worker_set_am_recv_handler(t->worker, &ha), err, err_worker);

    if (cfg->listen_host) {
        struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM,
                                 .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
        struct addrinfo *ai = NULL;
        char port[8];
        snprintf(port, sizeof port, "%u", cfg->listen_port);
        int gr = getaddrinfo(cfg->listen_host, port, &hints, &ai);
        if (gr != 0) {
            kt_seterr(err, "transport: cannot resolve listen address %s: %s", cfg->listen_host,
                      gai_strerror(gr));
            goto err_worker;
        }
        ucp_listener_params_t lp = {
            .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
            .sockaddr = {.addr = ai->ai_addr, .addrlen = ai->ai_addrlen},
            .conn_handler = {.cb = kt_on_conn_request, .arg = t},
        };
        st = ucp_listener_create(t->worker, &lp, &t->listener);
        freeaddrinfo(ai);
        if (st != UCS_OK) {
            kt_seterr(err, "transport: listening on %s:%u: ucp_listener_create failed: %s "
                      "(port in use, or UCX_TLS without tcp?)", cfg->listen_host,
                      cfg->listen_port, ucs_status_string(st));
            goto err_worker;
        }
        ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
        KT_UCS_CHECK(ucp_listener_query(t->listener, &la), err, err_listener);
        t->port = ntohs(((const struct sockaddr_in *)&la.sockaddr)->sin_port);
    }

    if (pthread_create(&t->thread, NULL, kt_progress_main, t) != 0) {
        kt_seterr(err, "transport: cannot start the progress thread");
        goto err_listener;
    }
    t->thread_started = 1;
    *out = t;
    return 0;

err_listener:
    if (t->listener)
        ucp_listener_destroy(t->listener);
err_worker:
    ucp_worker_destroy(t->worker);
err_ctx:
    ucp_cleanup(t->ctx);
err_fd:
    close(t->wake_fd);
err_free:
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->lock);
    free(t);
    return -1;
}

void kt_transport_destroy(kt_transport *t)
{
    if (!t)
        return;
    kt_api_lock(t);
    t->stopping = 1;
    pthread_mutex_unlock(&t->lock);
    kt_wake(t);
    pthread_join(t->thread, NULL);
    if (t->listener)
        ucp_listener_destroy(t->listener);
    while (t->conn_reqs) {
        kt_conn_req *cr = t->conn_reqs;
        t->conn_reqs = cr->next;
        free(cr);
    }
    ucp_worker_destroy(t->worker);
    ucp_cleanup(t->ctx);
    close(t->wake_fd);
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

uint16_t kt_transport_port(const kt_transport *t) { return t->port; }
