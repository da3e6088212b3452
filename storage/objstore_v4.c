/* objstore_v4.c - the V4 signer: libcurl's multi interface, CURLOPT_AWS_SIGV4 signing.
 *
 * The payload is not hashed (x-amz-content-sha256: UNSIGNED-PAYLOAD, which curl 7.88 takes
 * from the caller's headers instead of hashing the body itself); integrity comes from
 * Content-MD5 and the HEAD check. curl 7.88 puts the query string into the canonical
 * request as it is, so the listing's query is built here already sorted by name and
 * percent-encoded the way SigV4 wants (RFC 3986 unreserved characters kept, uppercase hex).
 * A loop owns one multi handle taken from a small per-handle pool, so that connections are
 * reused across calls (and threads, one at a time).
 */
#include "objstore_internal.h"

#include "log.h"

#include <curl/curl.h>
#include <errno.h>
#include <libxml/parser.h>
#include <libxml/tree.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define POOL_MAX 16
/* Largest answer body kept for parsing (a listing page of 1000 long keys is ~1.5 MB). */
#define BODY_MAX (32u << 20)

typedef struct v4_state {
    pthread_mutex_t mu;
    CURLM *pool[POOL_MAX];
    int npool;
} v4_state;

struct os_loop {
    objstore *s;
    CURLM *m;
};

typedef struct v4x {
    CURL *e;
    struct curl_slist *hdrs;
    char err[CURL_ERROR_SIZE];
    int added;
} v4x;

static int v4_init(objstore *s)
{
    v4_state *st = calloc(1, sizeof *st);
    if (!st) return -ENOMEM;
    pthread_mutex_init(&st->mu, NULL);
    s->be_state = st;
    return 0;
}

static void v4_fini(objstore *s)
{
    v4_state *st = s->be_state;
    if (!st) return;
    for (int i = 0; i < st->npool; i++) curl_multi_cleanup(st->pool[i]);
    pthread_mutex_destroy(&st->mu);
    free(st);
    s->be_state = NULL;
}

static int v4_loop_open(objstore *s, os_loop **out)
{
    v4_state *st = s->be_state;
    os_loop *l = calloc(1, sizeof *l);
    if (!l) return -ENOMEM;
    l->s = s;
    pthread_mutex_lock(&st->mu);
    if (st->npool) l->m = st->pool[--st->npool];
    pthread_mutex_unlock(&st->mu);
    if (!l->m) l->m = curl_multi_init();
    if (!l->m) {
        free(l);
        return -ENOMEM;
    }
    *out = l;
    return 0;
}

static void v4_loop_close(objstore *s, os_loop *l)
{
    v4_state *st = s->be_state;
    pthread_mutex_lock(&st->mu);
    if (st->npool < POOL_MAX) {
        st->pool[st->npool++] = l->m;
        l->m = NULL;
    }
    pthread_mutex_unlock(&st->mu);
    if (l->m) curl_multi_cleanup(l->m);
    free(l);
}

/* Percent-encode for a SigV4 query value. */
static void qenc(char *dst, size_t len, const char *src)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (; *src && o + 4 < len; src++) {
        unsigned char c = (unsigned char)*src;
        if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
            c == '-' || c == '_' || c == '.' || c == '~') {
            dst[o++] = (char)c;
        } else {
            dst[o++] = '%';
            dst[o++] = hex[c >> 4];
            dst[o++] = hex[c & 15];
        }
    }
    dst[o] = 0;
}

static void reset_answer(os_xfer *x)
{
    x->content_length = -1;
    x->range_total = -1;
    x->range_seen = 0;
    x->etag[0] = 0;
    x->meta_out[0] = 0;
}

static size_t on_header(char *p, size_t size, size_t nmemb, void *ud)
{
    os_xfer *x = ud;
    size_t n = size * nmemb;
    if (n >= 5 && !strncmp(p, "HTTP/", 5)) {
        const char *sp = memchr(p, ' ', n);
        x->http_status = sp ? atoi(sp + 1) : 0;
        reset_answer(x);
        return n;
    }
    const char *colon = memchr(p, ':', n);
    if (!colon) return n;
    size_t kn = (size_t)(colon - p);
    const char *v = colon + 1, *end = p + n;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ')) end--;
    size_t vn = (size_t)(end - v);
    char val[256];
    snprintf(val, sizeof val, "%.*s", (int)(vn < 255 ? vn : 255), v);
    if (kn == 14 && !strncasecmp(p, "Content-Length", kn)) {
        char *e = NULL;
        long long cl = strtoll(val, &e, 10);
        if (e != val && cl >= 0) x->content_length = cl;
    } else if (kn == 4 && !strncasecmp(p, "ETag", kn)) {
        os_copy_etag(x->etag, sizeof x->etag, v, vn);
    } else if (kn == 13 && !strncasecmp(p, "Content-Range", kn)) {
        x->range_seen = 1;
        const char *slash = strchr(val, '/');
        if (slash && slash[1] != '*') x->range_total = strtoll(slash + 1, NULL, 10);
    } else if (x->meta_name && kn == 11 + strlen(x->meta_name) &&
               !strncasecmp(p, "x-amz-meta-", 11) &&
               !strncasecmp(p + 11, x->meta_name, kn - 11)) {
        snprintf(x->meta_out, sizeof x->meta_out, "%.*s",
                 (int)(vn < sizeof x->meta_out - 1 ? vn : sizeof x->meta_out - 1), v);
    }
    return n;
}

static size_t keep_body(os_xfer *x, const char *p, size_t n)
{
    if (x->body_len + n > BODY_MAX) {
        x->local_err = -EIO;
        x->local_retry = 1;
        snprintf(x->msg, sizeof x->msg, "the answer's body is over %u bytes", BODY_MAX);
        return 0;
    }
    if (x->body_len + n + 1 > x->body_cap) {
        size_t cap = x->body_cap ? x->body_cap * 2 : 4096;
        while (cap < x->body_len + n + 1) cap *= 2;
        char *nb = realloc(x->body, cap);
        if (!nb) {
            x->local_err = -ENOMEM;
            snprintf(x->msg, sizeof x->msg, "out of memory for the answer");
            return 0;
        }
        x->body = nb;
        x->body_cap = cap;
    }
    memcpy(x->body + x->body_len, p, n);
    x->body_len += n;
    x->body[x->body_len] = 0;
    return n;
}

static size_t on_write(char *p, size_t size, size_t nmemb, void *ud)
{
    os_xfer *x = ud;
    size_t n = size * nmemb;
    if (x->kind == OS_X_GET && x->http_status >= 200 && x->http_status <= 299)
        return os_get_write(x, p, n) ? 0 : n;
    x->moved += n;
    return keep_body(x, p, n);
}

static size_t on_read(char *buf, size_t size, size_t nitems, void *ud)
{
    long r = os_put_read(ud, buf, size * nitems);
    return r < 0 ? CURL_READFUNC_ABORT : (size_t)r;
}

static int add_hdr(v4x *v, const char *fmt, const char *val)
{
    char line[4200];
    snprintf(line, sizeof line, fmt, val);
    struct curl_slist *n = curl_slist_append(v->hdrs, line);
    if (!n) return -ENOMEM;
    v->hdrs = n;
    return 0;
}

static void fail_start(os_xfer *x, int rc, const char *what)
{
    x->local_err = rc;
    x->local_retry = 0;
    snprintf(x->msg, sizeof x->msg, "%s", what);
    x->done = 1;
}

static int v4_start(os_loop *l, os_xfer *x)
{
    objstore *s = l->s;
    v4x *v = calloc(1, sizeof *v);
    if (!v) {
        fail_start(x, -ENOMEM, "out of memory");
        return -ENOMEM;
    }
    x->be = v;
    v->e = curl_easy_init();
    if (!v->e) {
        fail_start(x, -ENOMEM, "curl_easy_init failed");
        return -ENOMEM;
    }
    CURL *e = v->e;
    /* the URL */
    char base[700];
    if (s->path_style)
        snprintf(base, sizeof base, "%s/%s", s->endpoint, s->bucket);
    else
        snprintf(base, sizeof base, "%s://%s.%s", s->https ? "https" : "http", s->bucket, s->host);
    size_t ul = strlen(base) + 4 * 1100 + 3 * 1024 + 200;
    char *url = malloc(ul);
    if (!url) {
        fail_start(x, -ENOMEM, "out of memory");
        return -ENOMEM;
    }
    if (x->kind == OS_X_LIST) {
        /* names in byte order: continuation-token, delimiter, list-type, max-keys, prefix */
        char tok[3400] = "", del[16] = "", pre[3100] = "";
        if (x->list_token) qenc(tok, sizeof tok, x->list_token);
        if (x->list_delim) qenc(del, sizeof del, x->list_delim);
        if (x->list_prefix) qenc(pre, sizeof pre, x->list_prefix);
        int o = snprintf(url, ul, "%s%s?", base, s->path_style ? "" : "/");
        if (tok[0]) o += snprintf(url + o, ul - (size_t)o, "continuation-token=%s&", tok);
        if (del[0]) o += snprintf(url + o, ul - (size_t)o, "delimiter=%s&", del);
        o += snprintf(url + o, ul - (size_t)o, "list-type=2&max-keys=%u", x->list_max_keys);
        if (pre[0]) snprintf(url + o, ul - (size_t)o, "&prefix=%s", pre);
    } else {
        snprintf(url, ul, "%s/%s", base, x->key);
    }
    curl_easy_setopt(e, CURLOPT_URL, url);
    free(url);

    double left = x->deadline - os_now_s();
    long tmo = left > 0.001 ? (long)(left * 1000.0) : 1;
    char sigv4[100];
    snprintf(sigv4, sizeof sigv4, "aws:amz:%s:s3", s->region);
    curl_easy_setopt(e, CURLOPT_PRIVATE, x);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, v->err);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)(s->o.connect_timeout_s * 1000.0));
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, tmo);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, 10L);
    curl_easy_setopt(e, CURLOPT_AWS_SIGV4, sigv4);
    curl_easy_setopt(e, CURLOPT_USERNAME, x->cr.key_id);
    curl_easy_setopt(e, CURLOPT_PASSWORD, x->cr.secret);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, x);
    int rc = add_hdr(v, "%s", "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    /* Not "Expect:" (to turn off 100-continue): curl 7.88 puts the empty header into
     * SignedHeaders without sending it, and every request fails SignatureDoesNotMatch. The
     * Expect that curl adds itself for bodies over 1 MiB comes after signing and is fine. */
    if (!rc && x->cr.token[0]) rc = add_hdr(v, "x-amz-security-token: %s", x->cr.token);
    switch (x->kind) {
    case OS_X_PUT:
        curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(e, CURLOPT_READFUNCTION, on_read);
        curl_easy_setopt(e, CURLOPT_READDATA, x);
        curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)x->put_len);
        if (!rc) rc = add_hdr(v, "Content-MD5: %s", x->md5_b64);
        if (!rc && x->meta_name) {
            char h[300];
            snprintf(h, sizeof h, "x-amz-meta-%s: %%s", x->meta_name);
            rc = add_hdr(v, h, x->meta_value);
        }
        break;
    case OS_X_GET:
        if (!x->get_whole) {
            char r[80];
            snprintf(r, sizeof r, "%llu-%llu", (unsigned long long)x->get_offset,
                     (unsigned long long)(x->get_offset + x->get_len - 1));
            if (!rc) rc = add_hdr(v, "Range: bytes=%s", r);
        }
        break;
    case OS_X_HEAD:
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
        break;
    case OS_X_DELETE:
        curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, "DELETE");
        break;
    default:
        break;
    }
    if (rc) {
        fail_start(x, rc, "out of memory for the headers");
        return rc;
    }
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, v->hdrs);
    CURLMcode mc = curl_multi_add_handle(l->m, e);
    if (mc != CURLM_OK) {
        fail_start(x, -ENOMEM, curl_multi_strerror(mc));
        return -ENOMEM;
    }
    v->added = 1;
    return 0;
}

static void v4_stop(os_loop *l, os_xfer *x)
{
    v4x *v = x->be;
    if (!v) return;
    if (v->added) curl_multi_remove_handle(l->m, v->e);
    if (v->e) curl_easy_cleanup(v->e);
    curl_slist_free_all(v->hdrs);
    free(v);
    x->be = NULL;
}

static char *text_of(xmlNode *n, const char *name)
{
    for (xmlNode *c = n->children; c; c = c->next)
        if (c->type == XML_ELEMENT_NODE && !strcmp((const char *)c->name, name))
            return (char *)xmlNodeGetContent(c);
    return NULL;
}

/* A ListObjectsV2 page into x->acc; 0, or -1 (x->parse_failed / local_err set). */
static int parse_listing(os_xfer *x)
{
    xmlDoc *d = x->body_len && x->body_len < INT32_MAX
                    ? xmlReadMemory(x->body, (int)x->body_len, "list.xml", NULL,
                                    XML_PARSE_NONET | XML_PARSE_NOERROR | XML_PARSE_NOWARNING |
                                        XML_PARSE_HUGE)
                    : NULL;
    xmlNode *r = d ? xmlDocGetRootElement(d) : NULL;
    if (!r || strcmp((const char *)r->name, "ListBucketResult")) {
        x->parse_failed = 1;
        if (d && r && !strcmp((const char *)r->name, "Error")) os_parse_error_doc(x, x->body, x->body_len);
        xmlFreeDoc(d);
        return -1;
    }
    int rc = 0;
    for (xmlNode *c = r->children; c && !rc; c = c->next) {
        if (c->type != XML_ELEMENT_NODE) continue;
        const char *name = (const char *)c->name;
        if (!strcmp(name, "Contents")) {
            char *key = text_of(c, "Key"), *size = text_of(c, "Size"), *etag = text_of(c, "ETag");
            if (key) rc = os_list_add(x, key, size ? strtoull(size, NULL, 10) : 0, etag, 0);
            xmlFree(key);
            xmlFree(size);
            xmlFree(etag);
        } else if (!strcmp(name, "CommonPrefixes")) {
            char *p = text_of(c, "Prefix");
            if (p) rc = os_list_add(x, p, 0, NULL, 1);
            xmlFree(p);
        } else if (!strcmp(name, "IsTruncated")) {
            char *t = (char *)xmlNodeGetContent(c);
            x->list_truncated = t && !strcmp(t, "true");
            xmlFree(t);
        } else if (!strcmp(name, "NextContinuationToken")) {
            char *t = (char *)xmlNodeGetContent(c);
            if (t) snprintf(x->list_next, sizeof x->list_next, "%s", t);
            xmlFree(t);
        }
    }
    xmlFreeDoc(d);
    return rc ? -1 : 0;
}

static int transport_errno(CURL *e, CURLcode c)
{
    long os = 0;
    curl_easy_getinfo(e, CURLINFO_OS_ERRNO, &os);
    switch (c) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
        return -EHOSTUNREACH;
    case CURLE_COULDNT_CONNECT:
        if (os == EHOSTUNREACH || os == ENETUNREACH) return -EHOSTUNREACH;
        if (os == ETIMEDOUT) return -ETIMEDOUT;
        return -ECONNREFUSED;
    case CURLE_OPERATION_TIMEDOUT:
        return -ETIMEDOUT;
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
        return -ECONNRESET;
    case CURLE_OUT_OF_MEMORY:
        return -ENOMEM;
    default:
        return -EIO;
    }
}

static void finish(os_xfer *x, CURLcode res)
{
    v4x *v = x->be;
    if (res != CURLE_OK) {
        if (!x->local_err) {
            x->http_status = 0;
            x->curl_code = (int)res;
            x->transport = transport_errno(v->e, res);
            snprintf(x->msg, sizeof x->msg, "%.40s (curl: %.110s)",
                     x->transport == -EIO ? "transfer failed" : strerror(-x->transport),
                     v->err[0] ? v->err : curl_easy_strerror(res));
        }
        x->done = 1;
        return;
    }
    long st = 0;
    curl_easy_getinfo(v->e, CURLINFO_RESPONSE_CODE, &st);
    x->http_status = (int)st;
    if (st >= 200 && st <= 299) {
        if (x->kind == OS_X_LIST) {
            parse_listing(x);
        } else if (x->kind != OS_X_GET && x->body_len) {
            x->error_doc_2xx = os_parse_error_doc(x, x->body, x->body_len);
        }
    } else if (x->body_len) {
        os_parse_error_doc(x, x->body, x->body_len);
    }
    x->done = 1;
}

static void v4_wait(os_loop *l, double timeout_s)
{
    int running = 0, numfds = 0;
    int ms = (int)(timeout_s * 1000.0 + 0.999);
    curl_multi_poll(l->m, NULL, 0, ms, &numfds);
    curl_multi_perform(l->m, &running);
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(l->m, &left))) {
        if (msg->msg != CURLMSG_DONE) continue;
        os_xfer *x = NULL;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        if (x && !x->done) finish(x, msg->data.result);
    }
}

const os_backend os_backend_v4 = {
    "V4 (libcurl)", v4_init, v4_fini, v4_loop_open, v4_loop_close, v4_start, v4_stop, v4_wait,
};
