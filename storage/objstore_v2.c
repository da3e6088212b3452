/* objstore_v2.c - the V2 signer: libs3 2.0, each attempt in its own S3RequestContext.
 *
 * libs3 2.0 has no timeouts of its own and no way to abort one request of a context, so
 * each attempt gets a context of its own: this module's loop gathers the contexts' fd sets
 * into one select() bounded by the scheduler's wait, runs each context once, and ends an
 * attempt (deadline, cancel) by destroying its context. libs3 does not report the HTTP
 * status: http_status is the one its S3Status implies. What libs3 reports wrongly as
 * success (a cut GET body, a PUT refused after "100 Continue") is caught by objstore.c's
 * byte count and HEAD check; a 2xx PUT answer that carries a body (an error document) is
 * flagged here from its Content-Length and Content-Type.
 */
#include "objstore_internal.h"

#include "log.h"

#include <errno.h>
#include <libs3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/select.h>

static pthread_once_t g_s3_once = PTHREAD_ONCE_INIT;
static S3Status g_s3_init;

static void s3_init_once(void) { g_s3_init = S3_initialize("ckptsys", S3_INIT_ALL, NULL); }

typedef struct v2x {
    os_xfer *x;
    S3RequestContext *ctx;
    S3BucketContext bc;
    S3NameValue meta;
    S3PutProperties pp;
    int stopping;
    int put_body; /* a 2xx PUT answer announced a body */
    char put_ctype[64];
    char last[1100]; /* LIST: the greatest key or prefix seen (the next marker) */
} v2x;

struct os_loop {
    objstore *s;
    v2x **act;
    size_t n, cap;
};

static int v2_init(objstore *s)
{
    (void)s;
    pthread_once(&g_s3_once, s3_init_once);
    if (g_s3_init != S3StatusOK) {
        LOG_E(OS_TAG, "S3_initialize: %s", S3_get_status_name(g_s3_init));
        return -EIO;
    }
    return 0;
}

static void v2_fini(objstore *s) { (void)s; }

static int v2_loop_open(objstore *s, os_loop **out)
{
    os_loop *l = calloc(1, sizeof *l);
    if (!l) return -ENOMEM;
    l->s = s;
    *out = l;
    return 0;
}

static void v2_loop_close(objstore *s, os_loop *l)
{
    (void)s;
    free(l->act);
    free(l);
}

/* ---- callbacks (run inside S3_runonce_request_context, on the loop's thread) ---- */

static S3Status on_props(const S3ResponseProperties *p, void *ud)
{
    v2x *v = ud;
    os_xfer *x = v->x;
    if (v->stopping) return S3StatusOK;
    /* libs3 2.0 gives 0 when the header is absent; a HEAD of an empty object is 0 too */
    x->content_length = (int64_t)p->contentLength;
    if (p->eTag) os_copy_etag(x->etag, sizeof x->etag, p->eTag, strlen(p->eTag));
    if (x->meta_name)
        for (int i = 0; i < p->metaDataCount; i++)
            if (p->metaData[i].name && !strcasecmp(p->metaData[i].name, x->meta_name))
                snprintf(x->meta_out, sizeof x->meta_out, "%s",
                         p->metaData[i].value ? p->metaData[i].value : "");
    if (x->kind == OS_X_PUT && p->contentLength > 0) {
        v->put_body = 1;
        snprintf(v->put_ctype, sizeof v->put_ctype, "%s", p->contentType ? p->contentType : "");
    }
    if (x->kind == OS_X_GET && x->get_whole && p->contentLength > x->get_max) {
        x->local_err = -EFBIG;
        x->local_retry = 0;
        snprintf(x->msg, sizeof x->msg, "the object is larger than the %llu bytes allowed",
                 (unsigned long long)x->get_max);
        return S3StatusAbortedByCallback;
    }
    return S3StatusOK;
}

static int put_data(int size, char *buf, void *ud)
{
    v2x *v = ud;
    if (v->stopping || size <= 0) return 0;
    long r = os_put_read(v->x, buf, (size_t)size);
    return r < 0 ? -1 : (int)r;
}

static S3Status get_data(int size, const char *buf, void *ud)
{
    v2x *v = ud;
    if (v->stopping) return S3StatusAbortedByCallback;
    return os_get_write(v->x, buf, (size_t)size) ? S3StatusAbortedByCallback : S3StatusOK;
}

static void note_last(v2x *v, const char *k)
{
    if (k && strcmp(k, v->last) > 0) snprintf(v->last, sizeof v->last, "%s", k);
}

static S3Status list_cb(int truncated, const char *next, int nc, const S3ListBucketContent *c,
                        int np, const char **pre, void *ud)
{
    v2x *v = ud;
    os_xfer *x = v->x;
    if (v->stopping) return S3StatusAbortedByCallback;
    x->list_truncated = truncated;
    if (next && *next) snprintf(x->list_next, sizeof x->list_next, "%s", next);
    for (int i = 0; i < nc; i++) {
        if (os_list_add(x, c[i].key, c[i].size, c[i].eTag, 0)) return S3StatusAbortedByCallback;
        note_last(v, c[i].key);
    }
    for (int i = 0; i < np; i++) {
        if (os_list_add(x, pre[i], 0, NULL, 1)) return S3StatusAbortedByCallback;
        note_last(v, pre[i]);
    }
    return S3StatusOK;
}

/* The HTTP status an S3 error code is answered with. */
static int code_status(const char *code)
{
    static const struct { const char *c; int st; } t[] = {
        {"NoSuchKey", 404}, {"NoSuchBucket", 404}, {"AccessDenied", 403},
        {"InvalidAccessKeyId", 403}, {"SignatureDoesNotMatch", 403}, {"AccountProblem", 403},
        {"RequestTimeTooSkewed", 403}, {"NotSignedUp", 403}, {"InternalError", 500},
        {"SlowDown", 503}, {"InvalidRange", 416}, {"NotImplemented", 501},
        {"PermanentRedirect", 301}, {"TemporaryRedirect", 307}, {"Redirect", 307},
        {"MethodNotAllowed", 405}, {"PreconditionFailed", 412}, {"MissingContentLength", 411},
        {"OperationAborted", 409}, {"BucketAlreadyExists", 409}, {"BucketNotEmpty", 409},
        {"BucketAlreadyOwnedByYou", 409}, {"EntityTooLarge", 400}, {"RequestTimeout", 400},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(code, t[i].c)) return t[i].st;
    return 400;
}

static void on_complete(S3Status st, const S3ErrorDetails *ed, void *ud)
{
    v2x *v = ud;
    os_xfer *x = v->x;
    if (v->stopping || x->done) return;
    x->done = 1;
    if (ed && ed->message) snprintf(x->msg, sizeof x->msg, "%s", ed->message);
    const char *name = S3_get_status_name(st);
    if (st == S3StatusOK) {
        x->http_status = 200;
        if (x->kind == OS_X_PUT && v->put_body) {
            x->error_doc_2xx = 1;
            snprintf(x->msg, sizeof x->msg, "the PUT's answer has a body (Content-Type %s)",
                     v->put_ctype[0] ? v->put_ctype : "none");
        }
        if (x->kind == OS_X_LIST && x->list_truncated && !x->list_next[0])
            snprintf(x->list_next, sizeof x->list_next, "%s", v->last);
        return;
    }
    if (st >= S3StatusErrorAccessDenied && st < S3StatusErrorUnknown) {
        const char *c = name && !strncmp(name, "Error", 5) ? name + 5 : (name ? name : "");
        snprintf(x->code, sizeof x->code, "%s", c);
        x->http_status = code_status(x->code);
        return;
    }
    switch (st) {
    case S3StatusErrorUnknown:
        x->http_status = 500;
        if (!x->msg[0]) snprintf(x->msg, sizeof x->msg, "an S3 error code libs3 2.0 does not know");
        return;
    case S3StatusHttpErrorMovedTemporarily: x->http_status = 307; return;
    case S3StatusHttpErrorBadRequest: x->http_status = 400; return;
    case S3StatusHttpErrorForbidden: x->http_status = 403; return;
    case S3StatusHttpErrorNotFound: x->http_status = 404; return;
    case S3StatusHttpErrorConflict: x->http_status = 409; return;
    case S3StatusHttpErrorUnknown:
        x->http_status = 500;
        snprintf(x->msg, sizeof x->msg, "an HTTP error status libs3 2.0 does not name");
        return;
    case S3StatusNameLookupError: x->transport = -EHOSTUNREACH; break;
    case S3StatusFailedToConnect: x->transport = -ECONNREFUSED; break;
    case S3StatusConnectionFailed: x->transport = -ECONNRESET; break;
    case S3StatusInternalError: x->transport = -ECONNRESET; break; /* libs3's word for most curl errors */
    case S3StatusXmlParseFailure: x->transport = -EIO; break;
    case S3StatusInterrupted: x->transport = -ECANCELED; break;
    case S3StatusAbortedByCallback:
        if (!x->local_err) x->transport = -EIO;
        break;
    case S3StatusOutOfMemory:
        x->local_err = -ENOMEM;
        break;
    case S3StatusServerFailedVerification:
        x->local_err = -EIO;
        snprintf(x->msg, sizeof x->msg, "the server's TLS certificate was not accepted");
        break;
    default: /* a request libs3 refused to build */
        x->local_err = -EINVAL;
        snprintf(x->msg, sizeof x->msg, "libs3 refused the request: %s", name ? name : "?");
        break;
    }
    if (x->local_err) return; /* local_retry 0, or set by the helper that decided */
    x->http_status = 0;
    x->curl_code = -1;
    if (!x->msg[0] || st != S3StatusOK)
        snprintf(x->msg, sizeof x->msg, "%s (libs3: %s)", strerror(-x->transport),
                 name ? name : "?");
}

static int loop_add(os_loop *l, v2x *v)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        v2x **na = realloc(l->act, cap * sizeof *na);
        if (!na) return -ENOMEM;
        l->act = na;
        l->cap = cap;
    }
    l->act[l->n++] = v;
    return 0;
}

static void fail_start(os_xfer *x, int rc, const char *what)
{
    x->local_err = rc;
    x->local_retry = 0;
    snprintf(x->msg, sizeof x->msg, "%s", what);
    x->done = 1;
}

static int v2_start(os_loop *l, os_xfer *x)
{
    objstore *s = l->s;
    v2x *v = calloc(1, sizeof *v);
    if (!v || loop_add(l, v)) {
        free(v);
        fail_start(x, -ENOMEM, "out of memory");
        return -ENOMEM;
    }
    x->be = v;
    v->x = x;
    S3Status st = S3_create_request_context(&v->ctx);
    if (st != S3StatusOK) {
        v->ctx = NULL;
        fail_start(x, -ENOMEM, "S3_create_request_context failed");
        return -ENOMEM;
    }
    v->bc.hostName = s->host;
    v->bc.bucketName = s->bucket;
    v->bc.protocol = s->https ? S3ProtocolHTTPS : S3ProtocolHTTP;
    v->bc.uriStyle = s->path_style ? S3UriStylePath : S3UriStyleVirtualHost;
    v->bc.accessKeyId = x->cr.key_id;
    v->bc.secretAccessKey = x->cr.secret;
    S3ResponseHandler rh = {on_props, on_complete};
    switch (x->kind) {
    case OS_X_PUT: {
        v->pp.md5 = x->md5_b64;
        v->pp.expires = -1;
        v->pp.cannedAcl = S3CannedAclPrivate;
        if (x->meta_name) {
            v->meta.name = x->meta_name;
            v->meta.value = x->meta_value;
            v->pp.metaDataCount = 1;
            v->pp.metaData = &v->meta;
        }
        S3PutObjectHandler h = {rh, put_data};
        S3_put_object(&v->bc, x->key, x->put_len, &v->pp, v->ctx, &h, v);
        break;
    }
    case OS_X_GET: {
        S3GetObjectHandler h = {rh, get_data};
        S3_get_object(&v->bc, x->key, NULL, x->get_whole ? 0 : x->get_offset,
                      x->get_whole ? 0 : x->get_len, v->ctx, &h, v);
        break;
    }
    case OS_X_HEAD:
        S3_head_object(&v->bc, x->key, v->ctx, &rh, v);
        break;
    case OS_X_DELETE:
        S3_delete_object(&v->bc, x->key, v->ctx, &rh, v);
        break;
    case OS_X_LIST: {
        S3ListBucketHandler h = {rh, list_cb};
        S3_list_bucket(&v->bc, x->list_prefix && *x->list_prefix ? x->list_prefix : NULL,
                       x->list_token, x->list_delim, (int)x->list_max_keys, v->ctx, &h, v);
        break;
    }
    default:
        fail_start(x, -EINVAL, "unknown request kind");
        return -EINVAL;
    }
    if (!x->done) {
        int left = 0;
        S3_runonce_request_context(v->ctx, &left); /* starts the transfer */
    }
    return 0;
}

static void v2_stop(os_loop *l, os_xfer *x)
{
    v2x *v = x->be;
    if (!v) return;
    v->stopping = 1; /* the complete callback that destroying an unfinished context makes */
    if (v->ctx) S3_destroy_request_context(v->ctx);
    for (size_t i = 0; i < l->n; i++)
        if (l->act[i] == v) {
            l->act[i] = l->act[--l->n];
            break;
        }
    free(v);
    x->be = NULL;
}

static void v2_wait(os_loop *l, double timeout_s)
{
    fd_set r, w, e;
    FD_ZERO(&r);
    FD_ZERO(&w);
    FD_ZERO(&e);
    int maxfd = -1;
    int64_t ms = (int64_t)(timeout_s * 1000.0 + 0.999);
    for (size_t i = 0; i < l->n; i++) {
        v2x *v = l->act[i];
        if (v->x->done) continue;
        int m = -1;
        if (S3_get_request_context_fdsets(v->ctx, &r, &w, &e, &m) == S3StatusOK && m > maxfd)
            maxfd = m;
        int64_t t = S3_get_request_context_timeout(v->ctx);
        if (t >= 0 && t < ms) ms = t;
    }
    if (maxfd >= FD_SETSIZE) maxfd = -1; /* cannot select on it: poll by short sleeps */
    if (maxfd < 0 && ms > 5) ms = 5;     /* curl has no socket yet (resolving, connecting) */
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    if (maxfd >= 0)
        select(maxfd + 1, &r, &w, &e, &tv);
    else if (ms > 0)
        select(0, NULL, NULL, NULL, &tv);
    for (size_t i = 0; i < l->n; i++) {
        v2x *v = l->act[i];
        if (v->x->done) continue;
        int left = 0;
        S3Status st = S3_runonce_request_context(v->ctx, &left);
        if (st != S3StatusOK && !v->x->done) {
            os_xfer *x = v->x;
            x->done = 1;
            x->http_status = 0;
            x->curl_code = -1;
            x->transport = st == S3StatusOutOfMemory ? -ENOMEM : -EIO;
            snprintf(x->msg, sizeof x->msg, "libs3 could not run the request: %s",
                     S3_get_status_name(st));
        }
    }
}

const os_backend os_backend_v2 = {
    "V2 (libs3)", v2_init, v2_fini, v2_loop_open, v2_loop_close, v2_start, v2_stop, v2_wait,
};
