/* metrics_http.c - /metrics over HTTP with libmicrohttpd (metrics.h,
 * elastic_metrics_http_*).
 *
 * The listening socket is made and bound here and handed to MHD (MHD_OPTION_LISTEN_SOCKET):
 * MHD_start_daemon only says NULL when it fails, and a busy port deserves its errno. MHD runs
 * one internal thread; it is started with the asynchronous signals blocked (common/thread.h)
 * so that SIGTERM/SIGINT/SIGCHLD keep going to the agent's signalfd on the main thread. Each
 * scrape renders the whole text under the metrics' mutex, then MHD sends it on its own. */
#include "metrics.h"

#include "clock.h"
#include "log.h"
#include "thread.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define TAG "elastic"
#define CONN_LIMIT 64
#define CONN_TIMEOUT_S 10
#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct elastic_metrics_http {
    struct MHD_Daemon *d;
    elastic_metrics *m;
};

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
    LOG_W(TAG, "metrics server: %s", msg);
}

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, const char *type,
                             char *body, size_t len, int owned, const char *allow)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        if (owned) free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result q = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return q;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls)
{
    (void)version;
    (void)upload;
    elastic_metrics_http *h = cls;
    static char not_found[] = "not found: the metrics are at /metrics\n";
    static char not_allowed[] = "method not allowed: GET or HEAD\n";
    static char failed[] = "out of memory\n";
    if (*upload_size) { /* a request body: not ours to read */
        *upload_size = 0;
        return MHD_YES;
    }
    (void)con_cls;
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return reply(c, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", not_allowed,
                     sizeof not_allowed - 1, 0, "GET, HEAD");
    if (strcmp(url, "/metrics") != 0)
        return reply(c, MHD_HTTP_NOT_FOUND, "text/plain", not_found, sizeof not_found - 1, 0,
                     NULL);
    char *text = NULL;
    size_t len = 0;
    if (elastic_metrics_render(h->m, clock_now_s(), &text, &len) < 0)
        return reply(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", failed, sizeof failed - 1,
                     0, NULL);
    return reply(c, MHD_HTTP_OK, CONTENT_TYPE, text, len, 1, NULL);
}

/* A bound, listening, close-on-exec socket for addr:port; -errno (logged) on failure. */
static int listen_on(const char *addr, int port, int *v6)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int g = getaddrinfo(addr, ps, &hints, &res);
    if (g != 0) {
        LOG_E(TAG, "--metrics-addr %s: cannot resolve it: %s", addr,
              g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
        return -EINVAL;
    }
    int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
    int rc = 0;
    if (fd < 0) {
        rc = -errno;
        goto out;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one); /* TIME_WAIT of a last run */
    if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 64) != 0) {
        rc = -errno;
        close(fd);
        fd = -1;
    }
    *v6 = res->ai_family == AF_INET6;
out:
    freeaddrinfo(res);
    if (rc < 0) {
        LOG_E(TAG, "cannot serve metrics on %s:%d: %s", addr, port, strerror(-rc));
        return rc;
    }
    return fd;
}

int elastic_metrics_http_start(elastic_metrics_http **out, const char *addr, int port,
                               elastic_metrics *m)
{
    if (!out || !addr || !*addr || port < 1 || port > 65535 || !m) return -EINVAL;
    elastic_metrics_http *h = calloc(1, sizeof *h);
    if (!h) return -ENOMEM;
    h->m = m;
    int v6 = 0;
    int fd = listen_on(addr, port, &v6);
    if (fd < 0) {
        free(h);
        return fd;
    }
    unsigned flags = MHD_USE_AUTO | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    if (v6) flags |= MHD_USE_IPv6;
    sigset_t old;
    common_signals_block_async(&old); /* MHD's thread inherits the mask */
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, handle, h,
                            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                            MHD_OPTION_LISTEN_SOCKET, fd,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)CONN_LIMIT,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)CONN_TIMEOUT_S,
                            MHD_OPTION_END);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!h->d) {
        close(fd);
        free(h);
        LOG_E(TAG, "cannot serve metrics on %s:%d: the HTTP server did not start", addr, port);
        return -EIO;
    }
    LOG_I(TAG, "metrics on http://%s%s%s:%d/metrics", v6 ? "[" : "", addr, v6 ? "]" : "", port);
    *out = h;
    return 0;
}

void elastic_metrics_http_stop(elastic_metrics_http *h)
{
    if (!h) return;
    MHD_stop_daemon(h->d); /* joins its thread and closes the listening socket */
    free(h);
}
