/* objstore.c - what both signers share: URL and settings, credentials (re-read when the
 * file changes), retry classification, full-jitter backoff, and the scheduler that keeps up
 * to max_in_flight attempts going in one loop per call, with per-attempt and per-call
 * deadlines and a cancel flag checked at least every LOOP_TICK_S.
 *
 * Every finished attempt is judged here, whichever library ran it, so that what libs3 2.0
 * gets wrong (a cut GET body reported as success, "100 Continue" then a bare 500 reported
 * as success, no ETag for a PUT) is caught by the same checks: bytes counted on every GET,
 * and every PUT followed by a HEAD whose size and ETag must agree with what was sent.
 */
#include "objstore_internal.h"

#include "log.h"
#include "thread.h"

#include <pthread.h>

#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <libxml/parser.h>
#include <libxml/tree.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* Longest sleep of the loop between looks at the cancel flag and the deadlines. */
#define LOOP_TICK_S 0.05
/* V2 low-speed rule (curl does the same itself for V4): fewer than SLOW_BYTES moved in
 * SLOW_WINDOW_S seconds cuts the attempt. */
#define SLOW_WINDOW_S 10.0
#define SLOW_BYTES (10u * 1024u)
/* The largest single PUT S3 accepts. */
#define PUT_MAX (5ull << 30)
/* Credentials files larger than this are refused (a wrong path, not a credentials file). */
#define CRED_FILE_MAX (1u << 20)
/* Bytes read at a time by the MD5 pass over a file. */
#define MD5_CHUNK (1u << 20)

double os_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_init_rc;

static void global_init_once(void)
{
    xmlInitParser();
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) g_init_rc = -EIO;
}

int os_global_init(void)
{
    pthread_once(&g_once, global_init_once);
    return g_init_rc;
}

/* ---- names ---- */

static int is_key_char(int c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-' || c == '/';
}

/* A key or prefix of [A-Za-z0-9._/-]: no leading slash, no empty, "." or ".." segment
 * (curl folds dot segments of a URL path, so such a key would name another object). A
 * trailing slash is allowed only when allow_trailing. Returns NULL or what is wrong. */
static const char *path_problem(const char *p, size_t n, int allow_trailing)
{
    if (n == 0) return "is empty";
    for (size_t i = 0; i < n; i++)
        if (!is_key_char((unsigned char)p[i]))
            return "has a character outside [A-Za-z0-9._/-]";
    if (p[0] == '/') return "starts with a slash";
    if (!allow_trailing && p[n - 1] == '/') return "ends with a slash";
    size_t a = 0;
    while (a < n) {
        size_t b = a;
        while (b < n && p[b] != '/') b++;
        size_t seg = b - a;
        if (seg == 0 && b < n) return "has a double slash";
        if ((seg == 1 && p[a] == '.') || (seg == 2 && p[a] == '.' && p[a + 1] == '.'))
            return "has a \".\" or \"..\" segment";
        a = b + 1;
    }
    return NULL;
}

int objstore_parse_url(const char *url, char *bucket, size_t bucket_len, char *prefix,
                       size_t prefix_len, char *why, size_t why_len)
{
    if (!url || !bucket || !prefix || bucket_len == 0 || prefix_len == 0) {
        log_why(why, why_len, "no URL given");
        return -EINVAL;
    }
    if (strncmp(url, "s3://", 5) != 0) {
        log_why(why, why_len, "URL \"%.80s\" does not start with s3://", url);
        return -EINVAL;
    }
    const char *b = url + 5;
    size_t bn = strcspn(b, "/");
    if (bn < 3 || bn > 63) {
        log_why(why, why_len, "URL \"%.80s\": the bucket name must have 3 to 63 characters, "
                "not %zu", url, bn);
        return -EINVAL;
    }
    for (size_t i = 0; i < bn; i++) {
        char c = b[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-')) {
            log_why(why, why_len, "URL \"%.80s\": the bucket name may only have lowercase "
                    "letters, digits, '.' and '-'", url);
            return -EINVAL;
        }
    }
    if (!isalnum((unsigned char)b[0]) || !isalnum((unsigned char)b[bn - 1])) {
        log_why(why, why_len, "URL \"%.80s\": the bucket name must start and end with a "
                "letter or digit", url);
        return -EINVAL;
    }
    for (size_t i = 0; i + 1 < bn; i++)
        if (b[i] == '.' && (b[i + 1] == '.' || b[i + 1] == '-' || (i && b[i - 1] == '-'))) {
            log_why(why, why_len, "URL \"%.80s\": the bucket name has \"..\", \".-\" or "
                    "\"-.\"", url);
            return -EINVAL;
        }
    if (bn + 1 > bucket_len) {
        log_why(why, why_len, "bucket name too long for the buffer");
        return -EINVAL;
    }
    const char *p = b + bn;
    size_t pn = 0;
    if (*p == '/') {
        p++;
        pn = strlen(p);
        if (pn && p[pn - 1] == '/') pn--; /* one trailing slash is dropped */
        if (pn) {
            const char *bad = path_problem(p, pn, 0);
            if (bad) {
                log_why(why, why_len, "URL \"%.80s\": the prefix %s", url, bad);
                return -EINVAL;
            }
        }
    }
    if (pn > 900 || pn + 1 > prefix_len) {
        log_why(why, why_len, "URL \"%.60s...\": the prefix is longer than %zu bytes", url,
                prefix_len - 1 < 900 ? prefix_len - 1 : (size_t)900);
        return -EINVAL;
    }
    memcpy(bucket, b, bn);
    bucket[bn] = 0;
    memcpy(prefix, p, pn);
    prefix[pn] = 0;
    return 0;
}

/* "http[s]://host[:port][/]" into s->endpoint, s->host, s->https. */
static int parse_endpoint(objstore *s, const char *ep, char *why, size_t why_len)
{
    const char *h;
    if (!strncasecmp(ep, "http://", 7)) {
        s->https = 0;
        h = ep + 7;
    } else if (!strncasecmp(ep, "https://", 8)) {
        s->https = 1;
        h = ep + 8;
    } else {
        log_why(why, why_len, "endpoint (AWS_ENDPOINT_URL[_S3]) must start with http:// or "
                "https://");
        return -EINVAL;
    }
    /* No user:password@ (it could carry a secret into messages), query or path. */
    size_t n = strlen(h);
    if (n && h[n - 1] == '/') n--;
    size_t hn = 0;
    if (n && h[0] == '[') {
        while (hn < n && h[hn] != ']') hn++;
        if (hn == n || hn < 3) goto bad;
        for (size_t i = 1; i < hn; i++)
            if (!isxdigit((unsigned char)h[i]) && h[i] != ':' && h[i] != '.') goto bad;
        hn++;
    } else {
        while (hn < n && (isalnum((unsigned char)h[hn]) || h[hn] == '.' || h[hn] == '-')) hn++;
        if (hn == 0 || h[0] == '-' || h[0] == '.') goto bad;
    }
    if (hn > 253) goto bad;
    size_t end = hn;
    if (end < n && h[end] == ':') {
        size_t d = end + 1;
        unsigned long port = 0;
        while (d < n && isdigit((unsigned char)h[d]) && d - end <= 5) port = port * 10 + (unsigned)(h[d++] - '0');
        if (d == end + 1 || d != n || port == 0 || port > 65535) goto bad;
        end = d;
    }
    if (end != n) goto bad;
    snprintf(s->host, sizeof s->host, "%.*s", (int)n, h);
    snprintf(s->endpoint, sizeof s->endpoint, "%s://%s", s->https ? "https" : "http", s->host);
    return 0;
bad:
    log_why(why, why_len, "endpoint (AWS_ENDPOINT_URL[_S3]) is not http[s]://host[:port] "
            "(no user, path or query)");
    return -EINVAL;
}

/* ---- credentials ---- */

static void trim(const char **a, const char **b)
{
    while (*a < *b && (**a == ' ' || **a == '\t')) (*a)++;
    while (*b > *a && ((*b)[-1] == ' ' || (*b)[-1] == '\t' || (*b)[-1] == '\r')) (*b)--;
}

/* A control character (a CR, a line break, ...) in a key would go into the request's
 * headers as it is: an injected header, or a request the server cannot parse. */
static int has_ctl(const char *a, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)a[i] < 0x20 || (unsigned char)a[i] == 0x7f) return 1;
    return 0;
}

static int put_val(char *dst, size_t len, const char *a, const char *b)
{
    size_t n = (size_t)(b - a);
    if (n + 1 > len) return -EINVAL;
    if (has_ctl(a, n)) return -EILSEQ;
    memcpy(dst, a, n);
    dst[n] = 0;
    return 0;
}

int objstore_parse_credentials(const char *text, const char *profile, char *key_id,
                               size_t key_id_len, char *secret, size_t secret_len, char *token,
                               size_t token_len)
{
    if (!text || !profile || !key_id || !secret || !token || !key_id_len || !secret_len ||
        !token_len)
        return -EINVAL;
    key_id[0] = secret[0] = token[0] = 0;
    int in = 0, found = 0, rc = 0;
    size_t pl = strlen(profile);
    const char *line = text;
    while (*line) {
        const char *eol = strchr(line, '\n');
        if (!eol) eol = line + strlen(line);
        const char *a = line, *b = eol;
        line = *eol ? eol + 1 : eol;
        trim(&a, &b);
        if (a == b || *a == '#' || *a == ';') continue;
        if (*a == '[') {
            const char *c = memchr(a, ']', (size_t)(b - a));
            in = 0;
            if (!c) continue;
            const char *na = a + 1, *nb = c;
            trim(&na, &nb);
            if ((size_t)(nb - na) == pl && !memcmp(na, profile, pl)) in = found = 1;
            continue;
        }
        if (!in) continue;
        const char *eq = memchr(a, '=', (size_t)(b - a));
        if (!eq) continue;
        const char *ka = a, *kb = eq, *va = eq + 1, *vb = b;
        trim(&ka, &kb);
        trim(&va, &vb);
        size_t kn = (size_t)(kb - ka);
        int r = 0;
        if (kn == 17 && !strncasecmp(ka, "aws_access_key_id", kn))
            r = put_val(key_id, key_id_len, va, vb);
        else if (kn == 21 && !strncasecmp(ka, "aws_secret_access_key", kn))
            r = put_val(secret, secret_len, va, vb);
        else if (kn == 17 && !strncasecmp(ka, "aws_session_token", kn))
            r = put_val(token, token_len, va, vb);
        if (r && !rc) rc = r;
    }
    if (rc) {
        key_id[0] = secret[0] = token[0] = 0;
        return rc;
    }
    if (!found || !key_id[0] || !secret[0]) {
        key_id[0] = secret[0] = token[0] = 0;
        return -ENOENT;
    }
    return 0;
}

/* Read and parse the credentials file into *cr; st_out gets the file's fstat (taken before
 * the read, so that a write after it shows as a change next time). */
static int load_cred_file(const char *path, const char *profile, os_creds *cr,
                          struct stat *st_out, char *why, size_t why_len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        int e = errno;
        log_why(why, why_len, "%s: %s", path, strerror(e));
        return -e;
    }
    int rc = 0;
    char *text = NULL;
    struct stat st;
    if (fstat(fd, &st)) {
        rc = -errno;
        log_why(why, why_len, "%s: %s", path, strerror(-rc));
        goto out;
    }
    if (!S_ISREG(st.st_mode) || st.st_size > CRED_FILE_MAX) {
        rc = -EINVAL;
        log_why(why, why_len, "%s: not a regular file of at most %u bytes", path, CRED_FILE_MAX);
        goto out;
    }
    text = malloc((size_t)st.st_size + 1);
    if (!text) {
        rc = -ENOMEM;
        goto out;
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, text + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = -errno;
            log_why(why, why_len, "%s: %s", path, strerror(-rc));
            goto out;
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    text[got] = 0;
    if (memchr(text, 0, got)) {
        rc = -EINVAL;
        log_why(why, why_len, "%s: not a text file", path);
        goto out;
    }
    rc = objstore_parse_credentials(text, profile, cr->key_id, sizeof cr->key_id, cr->secret,
                                    sizeof cr->secret, cr->token, sizeof cr->token);
    if (rc == -ENOENT)
        log_why(why, why_len, "%s has no profile [%s] with aws_access_key_id and "
                "aws_secret_access_key", path, profile);
    else if (rc == -EILSEQ)
        log_why(why, why_len, "%s: a value in profile [%s] has a control character", path,
                profile);
    else if (rc)
        log_why(why, why_len, "%s: a value in profile [%s] is too long", path, profile);
    if (!rc && st_out) *st_out = st;
out:
    if (text) {
        /* the secret was in it */
        memset(text, 0, got < (size_t)st.st_size ? (size_t)st.st_size : got);
        free(text);
    }
    close(fd);
    return rc;
}

static int same_ts(struct timespec a, struct timespec b)
{
    return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

/* The credentials for the next attempt: the file is stat-ed and re-read when it changed; a
 * file that cannot be read now keeps the last good key (logged once). */
static void creds_get(objstore *s, os_creds *out)
{
    pthread_mutex_lock(&s->mu);
    if (s->creds_from_file) {
        struct stat st;
        if (stat(s->cred_path, &st) == 0) {
            if (!s->cred_have_st || st.st_dev != s->cred_dev || st.st_ino != s->cred_ino ||
                st.st_size != s->cred_size || !same_ts(st.st_mtim, s->cred_mtim) ||
                !same_ts(st.st_ctim, s->cred_ctim)) {
                os_creds nc;
                struct stat nst;
                char why[300];
                int rc = load_cred_file(s->cred_path, s->profile, &nc, &nst, why, sizeof why);
                if (rc == 0) {
                    int changed = strcmp(nc.key_id, s->cr.key_id) != 0 ||
                                  strcmp(nc.secret, s->cr.secret) != 0 ||
                                  strcmp(nc.token, s->cr.token) != 0;
                    s->cr = nc;
                    s->cred_have_st = 1;
                    s->cred_dev = nst.st_dev;
                    s->cred_ino = nst.st_ino;
                    s->cred_size = nst.st_size;
                    s->cred_mtim = nst.st_mtim;
                    s->cred_ctim = nst.st_ctim;
                    s->cred_warned = 0;
                    if (changed)
                        LOG_I(OS_TAG, "credentials re-read from %s (profile [%s], key id %.24s)",
                              s->cred_path, s->profile, nc.key_id);
                } else if (!s->cred_warned) {
                    s->cred_warned = 1;
                    LOG_W(OS_TAG, "credentials file changed but cannot be used (%s); keeping "
                          "the last key", why);
                }
                memset(&nc, 0, sizeof nc);
            }
        } else if (!s->cred_warned) {
            s->cred_warned = 1;
            LOG_W(OS_TAG, "credentials file %s: %s; keeping the last key", s->cred_path,
                  strerror(errno));
        }
    }
    *out = s->cr;
    pthread_mutex_unlock(&s->mu);
}

/* Replace every occurrence of the secret or token in text by "***" (a server's message
 * could quote what it got; nothing this module returns may carry a secret). */
static void scrub(char *text, size_t len, const os_creds *cr)
{
    const char *secrets[2] = {cr->secret, cr->token};
    for (int k = 0; k < 2; k++) {
        size_t sl = strlen(secrets[k]);
        if (sl < 4) continue;
        char *p;
        while ((p = strstr(text, secrets[k]))) {
            size_t tail = strlen(p + sl);
            memcpy(p, "***", 3);
            memmove(p + 3, p + sl, tail + 1);
            (void)len;
        }
    }
}

/* ---- retries ---- */

static int code_is(const char *c, const char *name) { return c && !strcmp(c, name); }

int objstore_retryable(int http_status, const char *s3_code, int curl_code)
{
    if (http_status == 0) {
        if (curl_code == -1 || curl_code == 0) return 1;
        switch (curl_code) {
        case CURLE_COULDNT_RESOLVE_PROXY:
        case CURLE_COULDNT_RESOLVE_HOST:
        case CURLE_COULDNT_CONNECT:
        case CURLE_WEIRD_SERVER_REPLY:
        case CURLE_HTTP2:
        case CURLE_PARTIAL_FILE:
        case CURLE_OPERATION_TIMEDOUT:
        case CURLE_SSL_CONNECT_ERROR:
        case CURLE_GOT_NOTHING:
        case CURLE_SEND_ERROR:
        case CURLE_RECV_ERROR:
        case CURLE_HTTP2_STREAM:
        case CURLE_HTTP3:
        case CURLE_QUIC_CONNECT_ERROR:
            return 1;
        default:
            return 0;
        }
    }
    static const char *const codes[] = {"InternalError", "SlowDown", "RequestTimeout",
                                        "RequestTimeTooSkewed", "ServiceUnavailable",
                                        "Throttling", "ThrottlingException", "RequestThrottled",
                                        "BadDigest", "IncompleteBody"};
    if (s3_code && *s3_code)
        for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
            if (code_is(s3_code, codes[i])) return 1;
    if (http_status == 408 || http_status == 429) return 1;
    if (http_status >= 500 && http_status <= 599) return 1;
    return 0;
}

double objstore_backoff_s(unsigned attempt, double base_s, double max_s, double u)
{
    if (attempt < 1) attempt = 1;
    if (!(base_s > 0) || !(max_s > 0)) return 0;
    if (!(u >= 0)) u = 0;
    if (u >= 1) u = nextafter(1.0, 0.0);
    double cap = attempt >= 64 ? max_s : base_s * ldexp(1.0, (int)attempt);
    if (cap > max_s) cap = max_s;
    return u * cap;
}

static double uniform01(objstore *s)
{
    uint64_t z = atomic_fetch_add(&s->rng, 0x9E3779B97F4A7C15ull) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

/* ---- open / close ---- */

static const char *env_nonempty(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

static double dflt(double v, double d) { return v == 0 ? d : v; }

int objstore_open(objstore **out, const objstore_opts *opts, char *why, size_t why_len)
{
    if (why && why_len) why[0] = 0;
    if (!out || !opts) {
        log_why(why, why_len, "objstore_open: no options");
        return -EINVAL;
    }
    *out = NULL;
    int rc = os_global_init();
    if (rc) {
        log_why(why, why_len, "libcurl could not be initialised");
        return rc;
    }
    objstore *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    pthread_mutex_init(&s->mu, NULL);
    s->o = *opts;
    s->o.url = NULL;
    objstore_opts *o = &s->o;
    if (!o->signature) o->signature = OBJSTORE_SIG_V4;
    o->connect_timeout_s = dflt(o->connect_timeout_s, 5.0);
    o->request_timeout_s = dflt(o->request_timeout_s, 60.0);
    o->backoff_base_s = dflt(o->backoff_base_s, 0.2);
    o->backoff_max_s = dflt(o->backoff_max_s, 10.0);
    if (!o->max_attempts) o->max_attempts = 6;
    if (!o->max_in_flight) o->max_in_flight = 8;
    if (!o->list_page_keys) o->list_page_keys = 1000;
    if ((o->signature != OBJSTORE_SIG_V4 && o->signature != OBJSTORE_SIG_V2) ||
        !(o->connect_timeout_s > 0 && o->connect_timeout_s <= 3600) ||
        !(o->request_timeout_s > 0 && o->request_timeout_s <= 86400) ||
        o->max_attempts > 100 || !(o->backoff_base_s > 0 && o->backoff_base_s <= 3600) ||
        !(o->backoff_max_s >= o->backoff_base_s && o->backoff_max_s <= 3600) ||
        o->max_in_flight > 256 || o->list_page_keys > 1000) {
        log_why(why, why_len, "objstore options out of range (signature 2 or 4, timeouts > 0, "
                "max_attempts 1..100, backoff_base_s <= backoff_max_s, max_in_flight 1..256, "
                "list_page_keys 1..1000)");
        rc = -EINVAL;
        goto fail;
    }
    rc = objstore_parse_url(opts->url, s->bucket, sizeof s->bucket, s->prefix, sizeof s->prefix,
                            why, why_len);
    if (rc) goto fail;

    const char *region = env_nonempty("AWS_REGION");
    if (!region) region = env_nonempty("AWS_DEFAULT_REGION");
    if (!region) region = "us-east-1";
    size_t rl = strlen(region);
    if (rl >= sizeof s->region || strspn(region, "abcdefghijklmnopqrstuvwxyz0123456789-") != rl) {
        log_why(why, why_len, "AWS_REGION \"%.40s\" is not a region name ([a-z0-9-], at most "
                "63 characters)", region);
        rc = -EINVAL;
        goto fail;
    }
    memcpy(s->region, region, rl + 1);

    const char *ep = env_nonempty("AWS_ENDPOINT_URL_S3");
    if (!ep) ep = env_nonempty("AWS_ENDPOINT_URL");
    if (ep) {
        rc = parse_endpoint(s, ep, why, why_len);
        if (rc) goto fail;
        s->path_style = 1;
    } else {
        s->https = 1;
        snprintf(s->host, sizeof s->host, "s3.%s.amazonaws.com", s->region);
        snprintf(s->endpoint, sizeof s->endpoint, "https://%s", s->host);
        /* A dotted bucket name breaks the TLS name check of bucket.s3...: path style. */
        s->path_style = strchr(s->bucket, '.') != NULL;
    }

    const char *kid = env_nonempty("AWS_ACCESS_KEY_ID");
    const char *sec = env_nonempty("AWS_SECRET_ACCESS_KEY");
    if (kid && sec) {
        const char *tok = env_nonempty("AWS_SESSION_TOKEN");
        if (strlen(kid) >= sizeof s->cr.key_id || strlen(sec) >= sizeof s->cr.secret ||
            (tok && strlen(tok) >= sizeof s->cr.token)) {
            log_why(why, why_len, "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or "
                    "AWS_SESSION_TOKEN is too long");
            rc = -EINVAL;
            goto fail;
        }
        const char *bad = has_ctl(kid, strlen(kid))       ? "AWS_ACCESS_KEY_ID"
                          : has_ctl(sec, strlen(sec))       ? "AWS_SECRET_ACCESS_KEY"
                          : tok && has_ctl(tok, strlen(tok)) ? "AWS_SESSION_TOKEN"
                                                             : NULL;
        if (bad) {
            log_why(why, why_len, "%s has a control character (a line break?)", bad);
            rc = -EINVAL;
            goto fail;
        }
        strcpy(s->cr.key_id, kid);
        strcpy(s->cr.secret, sec);
        if (tok) strcpy(s->cr.token, tok);
    } else {
        const char *path = env_nonempty("AWS_SHARED_CREDENTIALS_FILE");
        const char *home = env_nonempty("HOME");
        if (path)
            snprintf(s->cred_path, sizeof s->cred_path, "%s", path);
        else if (home)
            snprintf(s->cred_path, sizeof s->cred_path, "%s/.aws/credentials", home);
        const char *prof = env_nonempty("AWS_PROFILE");
        snprintf(s->profile, sizeof s->profile, "%s", prof ? prof : "default");
        char fwhy[300] = "HOME is not set";
        struct stat st;
        rc = s->cred_path[0] ? load_cred_file(s->cred_path, s->profile, &s->cr, &st, fwhy,
                                              sizeof fwhy)
                             : -ENOENT;
        if (rc) {
            log_why(why, why_len, "no credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                    "are not both set, and %s", fwhy);
            rc = -EACCES;
            goto fail;
        }
        s->creds_from_file = 1;
        s->cred_have_st = 1;
        s->cred_dev = st.st_dev;
        s->cred_ino = st.st_ino;
        s->cred_size = st.st_size;
        s->cred_mtim = st.st_mtim;
        s->cred_ctim = st.st_ctim;
    }
    if (o->signature == OBJSTORE_SIG_V2 && s->cr.token[0])
        LOG_W(OS_TAG, "a session token is set but signature V2 (libs3) cannot send it; "
              "requests may be refused");

    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    atomic_store(&s->rng, (uint64_t)ts.tv_nsec * 2654435761ull ^ (uint64_t)ts.tv_sec ^
                              ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)s);
    s->be = o->signature == OBJSTORE_SIG_V2 ? &os_backend_v2 : &os_backend_v4;
    rc = s->be->init(s);
    if (rc) {
        log_why(why, why_len, "%s could not be initialised", s->be->name);
        s->be = NULL;
        goto fail;
    }
    LOG_D(OS_TAG, "opened s3://%s/%s at %s (%s, region %s, %s addressing)", s->bucket,
          s->prefix, s->endpoint, s->be->name, s->region,
          s->path_style ? "path-style" : "virtual-host");
    *out = s;
    return 0;
fail:
    objstore_close(s);
    return rc;
}

void objstore_close(objstore *s)
{
    if (!s) return;
    if (s->be) s->be->fini(s);
    pthread_mutex_destroy(&s->mu);
    memset(&s->cr, 0, sizeof s->cr);
    free(s);
}

void objstore_cancel(objstore *s)
{
    if (s) atomic_store(&s->cancel, 1);
}

const char *objstore_bucket(const objstore *s) { return s ? s->bucket : NULL; }
const char *objstore_prefix(const objstore *s) { return s ? s->prefix : NULL; }
const char *objstore_endpoint(const objstore *s) { return s ? s->endpoint : NULL; }
int objstore_signature(const objstore *s) { return s ? s->o.signature : 0; }

/* ---- helpers for the backends ---- */

long os_put_read(os_xfer *x, void *buf, size_t n)
{
    uint64_t left = x->put_len - x->put_pos;
    if (n > left) n = (size_t)left;
    if (n == 0) return 0;
    if (x->put_data) {
        memcpy(buf, x->put_data + x->put_pos, n);
    } else {
        size_t got = 0;
        while (got < n) {
            ssize_t r = pread(x->put_fd, (char *)buf + got, n - got,
                              (off_t)(x->put_offset + x->put_pos + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                x->local_err = r < 0 ? -errno : -EINVAL;
                x->local_retry = 0;
                snprintf(x->msg, sizeof x->msg, "reading the body at offset %llu: %s",
                         (unsigned long long)(x->put_offset + x->put_pos + got),
                         r < 0 ? strerror(errno) : "the file ended early");
                return x->local_err;
            }
            got += (size_t)r;
        }
    }
    x->put_pos += n;
    x->moved += n;
    return (long)n;
}

int os_get_write(os_xfer *x, const void *p, size_t n)
{
    x->moved += n;
    if (!x->get_whole) {
        if (x->got + n > x->get_len) {
            x->local_err = -EIO;
            x->local_retry = 1;
            snprintf(x->msg, sizeof x->msg, "the answer's body is longer than the %llu bytes "
                     "asked for", (unsigned long long)x->get_len);
            return -1;
        }
        memcpy(x->get_buf + x->got, p, n);
        x->got += n;
        return 0;
    }
    if (x->got + n > x->get_max ||
        (x->content_length >= 0 && (uint64_t)x->content_length > x->get_max)) {
        x->local_err = -EFBIG;
        x->local_retry = 0;
        snprintf(x->msg, sizeof x->msg, "the object is larger than the %llu bytes allowed",
                 (unsigned long long)x->get_max);
        return -1;
    }
    if (x->got + n + 1 > x->whole_cap) {
        uint64_t cap = x->whole_cap ? x->whole_cap * 2 : 64 * 1024;
        if (x->content_length >= 0 && (uint64_t)x->content_length + 1 > cap)
            cap = (uint64_t)x->content_length + 1;
        while (cap < x->got + n + 1) cap *= 2;
        if (cap > x->get_max + 1) cap = x->get_max + 1;
        char *nb = realloc(x->whole, (size_t)cap);
        if (!nb) {
            x->local_err = -ENOMEM;
            x->local_retry = 0;
            snprintf(x->msg, sizeof x->msg, "out of memory for the body");
            return -1;
        }
        x->whole = nb;
        x->whole_cap = cap;
    }
    memcpy(x->whole + x->got, p, n);
    x->got += n;
    return 0;
}

int os_list_add(os_xfer *x, const char *key, uint64_t size, const char *etag, int is_prefix)
{
    os_list_acc *a = x->acc;
    if (a->n >= a->max) {
        x->local_err = -EFBIG;
        x->local_retry = 0;
        snprintf(x->msg, sizeof x->msg, "more than %zu entries", a->max);
        return -EFBIG;
    }
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        objstore_entry *ne = realloc(a->e, cap * sizeof *ne);
        if (!ne) goto nomem;
        a->e = ne;
        a->cap = cap;
    }
    objstore_entry *e = &a->e[a->n];
    memset(e, 0, sizeof *e);
    e->key = strdup(key ? key : "");
    if (!e->key) goto nomem;
    e->size = is_prefix ? 0 : size;
    e->is_prefix = is_prefix;
    if (etag) os_copy_etag(e->etag, sizeof e->etag, etag, strlen(etag));
    a->n++;
    return 0;
nomem:
    x->local_err = -ENOMEM;
    x->local_retry = 0;
    snprintf(x->msg, sizeof x->msg, "out of memory for the listing");
    return -ENOMEM;
}

void os_copy_etag(char *dst, size_t dst_len, const char *src, size_t n)
{
    while (n && (*src == '"' || *src == ' ')) {
        src++;
        n--;
    }
    while (n && (src[n - 1] == '"' || src[n - 1] == ' ' || src[n - 1] == '\r' ||
                 src[n - 1] == '\n'))
        n--;
    if (n >= dst_len) n = dst_len - 1;
    memcpy(dst, src, n);
    dst[n] = 0;
}

static xmlNode *child(xmlNode *n, const char *name)
{
    for (xmlNode *c = n ? n->children : NULL; c; c = c->next)
        if (c->type == XML_ELEMENT_NODE && !strcmp((const char *)c->name, name)) return c;
    return NULL;
}

int os_parse_error_doc(os_xfer *x, const char *body, size_t len)
{
    if (!body || !len || len > INT32_MAX) return 0;
    xmlDoc *d = xmlReadMemory(body, (int)len, "error.xml", NULL,
                              XML_PARSE_NONET | XML_PARSE_NOERROR | XML_PARSE_NOWARNING);
    if (!d) return 0;
    int is_err = 0;
    xmlNode *r = xmlDocGetRootElement(d);
    if (r && !strcmp((const char *)r->name, "Error")) {
        is_err = 1;
        xmlNode *c = child(r, "Code"), *m = child(r, "Message");
        xmlChar *ct = c ? xmlNodeGetContent(c) : NULL;
        xmlChar *mt = m ? xmlNodeGetContent(m) : NULL;
        if (ct) snprintf(x->code, sizeof x->code, "%s", (const char *)ct);
        if (mt) snprintf(x->msg, sizeof x->msg, "%s", (const char *)mt);
        xmlFree(ct);
        xmlFree(mt);
    }
    xmlFreeDoc(d);
    return is_err;
}

/* ---- the scheduler ---- */

/* One listing page as a request of the scheduler. */
typedef struct list_req {
    const char *prefix, *delim, *token;
    os_list_acc *acc;
    int truncated;
    char next[1100];
} list_req;

enum { PH_MAIN = 1, PH_VERIFY = 2, PH_BACKOFF = 3, PH_HASH = 4 /* waiting for its MD5 */ };
enum { OUT_OK = 0, OUT_RETRY = 1, OUT_FAIL = 2 };

typedef struct slot {
    objstore_op *op; /* NULL: free */
    int phase;
    int running; /* x started and not yet stopped */
    os_xfer x;
    char md5_hex[33];
    char md5_b64[32];
    double backoff_until;
    double deadline; /* of the call; 0 none */
    size_t acc_mark; /* LIST: entries before this page's attempt */
    char reason[240]; /* of the last failed attempt */
} slot;

/* The MD5s of a batch's PUT bodies, computed ahead on a thread of their own in op order, so
 * that hashing a large part never stalls the transfers already in flight (the request loop
 * would otherwise stop moving bytes for the ~0.4 s a 256 MiB part takes). */
typedef struct hasher {
    objstore *s;
    objstore_op *ops;
    size_t n;
    char (*hex)[33];
    char (*b64)[32];
    int *rc;
    char (*reason)[240];
    atomic_size_t ready; /* ops [0, ready) are done (PUT or not) */
    atomic_int stop;
    pthread_t tid;
} hasher;

typedef struct batch {
    objstore *s;
    os_loop *loop;
    list_req *lr;
    unsigned char *md5_buf;
    objstore_op *ops;
    hasher *h; /* NULL: MD5s computed in slot_begin */
} batch;

static const char *kind_name(int kind)
{
    switch (kind) {
    case OS_X_PUT: return "PUT";
    case OS_X_GET: return "GET";
    case OS_X_HEAD: return "HEAD";
    case OS_X_DELETE: return "DELETE";
    case OS_X_LIST: return "LIST";
    default: return "?";
    }
}

static int validate_op(objstore_op *op, char *why, size_t why_len)
{
    if (op->kind < OBJSTORE_PUT || op->kind > OBJSTORE_DELETE) {
        log_why(why, why_len, "op kind %d is not PUT, GET, HEAD or DELETE", op->kind);
        return -EINVAL;
    }
    size_t kl = op->key ? strnlen(op->key, 1025) : 0;
    const char *bad = kl > 1024 ? "is longer than 1024 bytes" : path_problem(op->key, kl, 1);
    if (!op->key) bad = "is missing";
    if (bad) {
        log_why(why, why_len, "%s: the key %s", kind_name(op->kind), bad);
        return -EINVAL;
    }
    if (op->meta_name) {
        size_t mn = strlen(op->meta_name);
        if (mn < 1 || mn > 64 || strspn(op->meta_name, "abcdefghijklmnopqrstuvwxyz0123456789-") != mn) {
            log_why(why, why_len, "%s %.200s: meta_name must be [a-z0-9-]{1,64}",
                    kind_name(op->kind), op->key);
            return -EINVAL;
        }
    }
    if (op->kind == OBJSTORE_PUT) {
        if (!op->put_data && op->put_fd < 0) {
            log_why(why, why_len, "PUT %.200s: neither put_data nor put_fd", op->key);
            return -EINVAL;
        }
        if (op->put_len > PUT_MAX || (!op->put_data && op->put_offset > INT64_MAX - op->put_len)) {
            log_why(why, why_len, "PUT %.200s: put_len %llu is over the 5 GiB of one PUT",
                    op->key, (unsigned long long)op->put_len);
            return -EINVAL;
        }
        if (op->meta_name) {
            size_t vl = strnlen(op->meta_value, sizeof op->meta_value);
            for (size_t i = 0; i < vl; i++)
                if (op->meta_value[i] < 0x20 || op->meta_value[i] > 0x7e) vl = sizeof op->meta_value;
            if (vl >= sizeof op->meta_value) {
                log_why(why, why_len, "PUT %.200s: meta_value must be printable ASCII of at "
                        "most 127 bytes", op->key);
                return -EINVAL;
            }
        }
    }
    if (op->kind == OBJSTORE_GET) {
        int whole = !op->get_buf && op->get_len == 0;
        if (whole ? op->get_max == 0 || op->get_max > (1ull << 40)
                  : (!op->get_buf || op->get_len == 0 ||
                     op->get_offset > UINT64_MAX - op->get_len)) {
            log_why(why, why_len, "GET %.200s: give get_buf with get_len > 0, or neither with "
                    "get_max > 0", op->key);
            return -EINVAL;
        }
    }
    return 0;
}

/* Reason of a finished attempt in words (no endpoint/key: the caller adds them). */
static void describe(const os_xfer *x, char *out, size_t len)
{
    if (x->local_err) {
        snprintf(out, len, "%s", x->msg);
    } else if (x->http_status == 0) {
        snprintf(out, len, "no answer: %s", x->msg[0] ? x->msg : strerror(-x->transport));
    } else if (!x->code[0] && !x->msg[0]) {
        const char *what = x->http_status == 403   ? "Forbidden (refused credentials or no "
                                                     "permission)"
                           : x->http_status == 404 ? "Not Found"
                           : x->http_status == 400 ? "Bad Request"
                           : x->http_status == 503 ? "Service Unavailable"
                           : x->http_status >= 500 ? "server error"
                                                   : "";
        snprintf(out, len, "HTTP %d%s%s", x->http_status, what[0] ? " " : "", what);
    } else {
        snprintf(out, len, "HTTP %d%s%s%s%.120s", x->http_status, x->code[0] ? " " : "",
                 x->code, x->msg[0] ? ": " : "", x->msg);
    }
}

static int status_rc(int status, const char *code)
{
    if (status == 404) return code_is(code, "NoSuchBucket") ? -ENXIO : -ENOENT;
    if (status == 403 || status == 401) return -EACCES;
    if (status == 416 || code_is(code, "InvalidRange")) return -ERANGE;
    if (status == 400 || (status >= 300 && status < 400)) return -EINVAL;
    return -EIO;
}

/* A 2xx GET whose body is an S3 error document instead of the object (some gateways and
 * proxies answer so; docs/OPERATIONS.md lists it as retried). The body went into the GET's
 * buffer, so it is looked at there, and only when it cannot be the data asked for: a ranged
 * answer shorter than the range, or a whole object whose first byte is '<' (manifests are
 * JSON). */
static int get_error_doc(os_xfer *x)
{
    const unsigned char *b = x->get_whole ? (const unsigned char *)x->whole : x->get_buf;
    if (!b || x->got == 0 || x->got > 64 * 1024) return 0;
    if (!x->get_whole && x->got >= x->get_len) return 0;
    uint64_t i = 0;
    while (i < x->got && isspace(b[i])) i++;
    if (i == x->got || b[i] != '<') return 0;
    return os_parse_error_doc(x, (const char *)b, (size_t)x->got);
}

/* Judge a finished attempt: OUT_OK, OUT_RETRY or OUT_FAIL with *rc and sl->reason. */
static int judge(objstore *s, slot *sl, int *rc)
{
    os_xfer *x = &sl->x;
    *rc = 0;
    sl->reason[0] = 0;
    if (x->local_err) {
        *rc = x->local_err;
        describe(x, sl->reason, sizeof sl->reason);
        return x->local_retry ? OUT_RETRY : OUT_FAIL;
    }
    if (x->http_status == 0) {
        *rc = x->transport ? x->transport : -EIO;
        describe(x, sl->reason, sizeof sl->reason);
        return objstore_retryable(0, NULL, x->curl_code) ? OUT_RETRY : OUT_FAIL;
    }
    int st = x->http_status;
    if (st >= 200 && st <= 299) {
        if (x->error_doc_2xx) {
            *rc = -EIO;
            snprintf(sl->reason, sizeof sl->reason, "HTTP %d with an error document: %s%s%.120s",
                     st, x->code[0] ? x->code : "(no code)", x->msg[0] ? ": " : "", x->msg);
            return OUT_RETRY;
        }
        if (x->kind == OS_X_GET && get_error_doc(x)) {
            *rc = -EIO;
            snprintf(sl->reason, sizeof sl->reason, "HTTP %d with an error document, not "
                     "the object: %s%s%.100s", st, x->code[0] ? x->code : "(no code)",
                     x->msg[0] ? ": " : "", x->msg);
            return OUT_RETRY;
        }
        if (x->kind == OS_X_LIST && x->parse_failed) {
            *rc = -EBADMSG;
            snprintf(sl->reason, sizeof sl->reason, "HTTP %d whose body is not a listing%s%.100s",
                     st, x->msg[0] ? ": " : "", x->msg);
            return OUT_RETRY;
        }
        if (x->kind == OS_X_GET && !x->get_whole) {
            uint64_t end = x->get_offset + x->get_len;
            if (x->range_total >= 0 && end > (uint64_t)x->range_total) {
                *rc = -ERANGE;
                snprintf(sl->reason, sizeof sl->reason, "the object has %lld bytes, the range "
                         "ends at %llu", (long long)x->range_total, (unsigned long long)end);
                return OUT_FAIL;
            }
            /* The server announced fewer bytes than asked (a cut body still announces them
             * all): the object ends inside the range. libs3 hides Content-Range, so this is
             * how V2 tells it from a cut. */
            if (x->content_length > 0 && (uint64_t)x->content_length < x->get_len &&
                x->got == (uint64_t)x->content_length) {
                *rc = -ERANGE;
                snprintf(sl->reason, sizeof sl->reason, "the answer has %lld of the %llu bytes "
                         "asked for: the object ends inside the range",
                         (long long)x->content_length, (unsigned long long)x->get_len);
                return OUT_FAIL;
            }
            if (s->o.signature == OBJSTORE_SIG_V4 && st != 206 &&
                !(x->get_offset == 0 && x->content_length == (int64_t)x->get_len)) {
                *rc = -EIO;
                snprintf(sl->reason, sizeof sl->reason, "HTTP %d to a ranged GET: the server "
                         "ignored the Range header", st);
                return OUT_FAIL;
            }
            if (x->got != x->get_len) {
                *rc = -EIO;
                snprintf(sl->reason, sizeof sl->reason, "body cut short: %llu of %llu bytes",
                         (unsigned long long)x->got, (unsigned long long)x->get_len);
                return OUT_RETRY;
            }
        }
        if (x->kind == OS_X_GET && x->get_whole && x->content_length >= 0 &&
            x->got != (uint64_t)x->content_length) {
            *rc = -EIO;
            snprintf(sl->reason, sizeof sl->reason, "body cut short: %llu of %lld bytes",
                     (unsigned long long)x->got, (long long)x->content_length);
            return OUT_RETRY;
        }
        if (x->kind == OS_X_HEAD && x->content_length < 0) {
            *rc = -EIO;
            snprintf(sl->reason, sizeof sl->reason, "HEAD answer without Content-Length");
            return OUT_RETRY;
        }
        return OUT_OK;
    }
    if (x->kind == OS_X_DELETE && st == 404 && !code_is(x->code, "NoSuchBucket")) return OUT_OK;
    describe(x, sl->reason, sizeof sl->reason);
    if (objstore_retryable(st, x->code, 0)) {
        *rc = -EIO;
        return OUT_RETRY;
    }
    *rc = status_rc(st, x->code);
    return OUT_FAIL;
}

static void xfer_clear(os_xfer *x)
{
    free(x->whole);
    free(x->body);
    memset(x, 0, sizeof *x);
}

static void slot_stop(batch *b, slot *sl)
{
    if (sl->running) {
        b->s->be->stop(b->loop, &sl->x);
        sl->running = 0;
    }
}

static void op_finish(batch *b, slot *sl, int rc, const char *reason)
{
    objstore *s = b->s;
    objstore_op *op = sl->op;
    slot_stop(b, sl);
    op->rc = rc;
    if (rc) {
        char where[1200];
        if (op->kind == OS_X_LIST)
            snprintf(where, sizeof where, "LIST s3://%s/%s*", s->bucket,
                     b->lr && b->lr->prefix ? b->lr->prefix : "");
        else
            snprintf(where, sizeof where, "%s s3://%s/%s", kind_name(op->kind), s->bucket,
                     op->key);
        char text[1600];
        snprintf(text, sizeof text, "%.400s at %s: %s (%u attempt%s)", where, s->endpoint,
                 reason, op->attempts, op->attempts == 1 ? "" : "s");
        scrub(text, sizeof text, &sl->x.cr);
        log_why(op->why, sizeof op->why, "%s", text);
        if (op->kind == OS_X_LIST && b->lr) {
            os_list_acc *a = b->lr->acc;
            while (a->n > sl->acc_mark) free(a->e[--a->n].key);
        }
    }
    memset(&sl->x.cr, 0, sizeof sl->x.cr);
    xfer_clear(&sl->x);
    sl->op = NULL;
}

/* MD5 of a PUT body: hex and base64 into the slot. 0 or -errno (reason set). */
/* MD5 of op's body (put_data, or pread of put_fd) as hex and base64; buf: MD5_CHUNK bytes of
 * scratch (allocated into *buf when NULL). 0 or -errno with reason. */
static int md5_of(objstore *s, const objstore_op *op, unsigned char **buf, char hex[33],
                  char b64[32], char *reason, size_t reason_len, atomic_int *stop)
{
    int rc = 0;
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    if (!c || !EVP_DigestInit_ex(c, EVP_md5(), NULL)) {
        snprintf(reason, reason_len, "libcrypto has no MD5");
        rc = -EIO;
        goto out;
    }
    for (uint64_t pos = 0; pos < op->put_len;) {
        if (atomic_load(&s->cancel) || (stop && atomic_load(stop))) {
            rc = -ECANCELED;
            snprintf(reason, reason_len, "cancelled");
            goto out;
        }
        size_t n = op->put_len - pos < MD5_CHUNK ? (size_t)(op->put_len - pos) : MD5_CHUNK;
        const void *p;
        if (op->put_data) {
            p = (const unsigned char *)op->put_data + pos;
        } else {
            if (!*buf && !(*buf = malloc(MD5_CHUNK))) {
                rc = -ENOMEM;
                snprintf(reason, reason_len, "out of memory");
                goto out;
            }
            ssize_t r = pread(op->put_fd, *buf, n, (off_t)(op->put_offset + pos));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                rc = r < 0 ? -errno : -EINVAL;
                snprintf(reason, reason_len, "reading the body at offset %llu: %s",
                         (unsigned long long)(op->put_offset + pos),
                         r < 0 ? strerror(errno) : "the file ends before put_offset + put_len");
                goto out;
            }
            n = (size_t)r;
            p = *buf;
        }
        EVP_DigestUpdate(c, p, n);
        pos += n;
    }
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdn = 0;
    EVP_DigestFinal_ex(c, md, &mdn);
    for (unsigned i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    EVP_EncodeBlock((unsigned char *)b64, md, 16);
out:
    EVP_MD_CTX_free(c);
    return rc;
}

static int put_md5(batch *b, slot *sl)
{
    return md5_of(b->s, sl->op, &b->md5_buf, sl->md5_hex, sl->md5_b64, sl->reason,
                  sizeof sl->reason, NULL);
}

static void *hasher_main(void *arg)
{
    hasher *h = arg;
    unsigned char *buf = NULL;
    for (size_t i = 0; i < h->n && !atomic_load(&h->stop); i++) {
        if (h->ops[i].kind == OS_X_PUT)
            h->rc[i] = md5_of(h->s, &h->ops[i], &buf, h->hex[i], h->b64[i], h->reason[i],
                              sizeof h->reason[i], &h->stop);
        atomic_store(&h->ready, i + 1);
    }
    free(buf);
    return NULL;
}

/* Start a hasher for a batch with PUTs (NULL when none, or when it cannot start: then the
 * MD5s are computed in slot_begin as before). */
static hasher *hasher_start(objstore *s, objstore_op *ops, size_t n)
{
    size_t puts = 0;
    for (size_t i = 0; i < n; i++) puts += ops[i].kind == OS_X_PUT && ops[i].put_len > 0;
    if (puts == 0) return NULL;
    hasher *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->s = s;
    h->ops = ops;
    h->n = n;
    h->hex = calloc(n, sizeof *h->hex);
    h->b64 = calloc(n, sizeof *h->b64);
    h->rc = calloc(n, sizeof *h->rc);
    h->reason = calloc(n, sizeof *h->reason);
    atomic_init(&h->ready, 0);
    atomic_init(&h->stop, 0);
    if (!h->hex || !h->b64 || !h->rc || !h->reason ||
        common_thread_start(&h->tid, hasher_main, h) != 0) {
        free(h->hex);
        free(h->b64);
        free(h->rc);
        free(h->reason);
        free(h);
        return NULL;
    }
    return h;
}

static void hasher_stop(hasher *h)
{
    if (!h) return;
    atomic_store(&h->stop, 1);
    pthread_join(h->tid, NULL);
    free(h->hex);
    free(h->b64);
    free(h->rc);
    free(h->reason);
    free(h);
}

/* A PUT slot waiting for its MD5: 1 when it is there (copied into the slot, or the op
 * finished with the hasher's error), 0 while it is not. */
static int take_md5(batch *b, slot *sl)
{
    size_t i = (size_t)(sl->op - b->ops);
    if (atomic_load(&b->h->ready) <= i) return 0;
    if (b->h->rc[i]) {
        snprintf(sl->reason, sizeof sl->reason, "%s", b->h->reason[i]);
        return -1;
    }
    memcpy(sl->md5_hex, b->h->hex[i], sizeof sl->md5_hex);
    memcpy(sl->md5_b64, b->h->b64[i], sizeof sl->md5_b64);
    return 1;
}

static void attempt_start(batch *b, slot *sl, int phase, double now)
{
    objstore *s = b->s;
    objstore_op *op = sl->op;
    os_xfer *x = &sl->x;
    xfer_clear(x);
    x->s = s;
    x->content_length = -1;
    x->range_total = -1;
    x->key = op->key;
    creds_get(s, &x->cr);
    sl->phase = phase;
    if (phase == PH_VERIFY) {
        x->kind = OS_X_HEAD;
    } else {
        op->attempts++;
        x->kind = op->kind;
        if (op->kind == OS_X_PUT) {
            x->put_data = op->put_data;
            x->put_fd = op->put_fd;
            x->put_offset = op->put_offset;
            x->put_len = op->put_len;
            memcpy(x->md5_b64, sl->md5_b64, sizeof x->md5_b64);
            if (op->meta_name) {
                x->meta_name = op->meta_name;
                x->meta_value = op->meta_value;
            }
        } else if (op->kind == OS_X_GET) {
            x->get_whole = !op->get_buf;
            x->get_buf = op->get_buf;
            x->get_offset = op->get_offset;
            x->get_len = op->get_len;
            x->get_max = op->get_max;
            x->meta_name = op->meta_name;
        } else if (op->kind == OS_X_HEAD) {
            x->meta_name = op->meta_name;
        } else if (op->kind == OS_X_LIST) {
            list_req *lr = b->lr;
            x->list_prefix = lr->prefix;
            x->list_delim = lr->delim;
            x->list_token = lr->token;
            x->list_max_keys = s->o.list_page_keys;
            x->acc = lr->acc;
            while (lr->acc->n > sl->acc_mark) free(lr->acc->e[--lr->acc->n].key); /* a retry */
        }
    }
    x->deadline = now + s->o.request_timeout_s;
    if (sl->deadline > 0 && sl->deadline < x->deadline) x->deadline = sl->deadline;
    x->speed_t = now;
    sl->running = 1;
    s->be->start(b->loop, x); /* a failure to start comes back as a finished attempt */
}

/* An attempt failed: back off and go again, or give up. */
static void retry_or_fail(batch *b, slot *sl, int rc, double now)
{
    objstore *s = b->s;
    objstore_op *op = sl->op;
    slot_stop(b, sl);
    if (op->attempts >= s->o.max_attempts) {
        op_finish(b, sl, rc, sl->reason);
        return;
    }
    double wait = objstore_backoff_s(op->attempts, s->o.backoff_base_s, s->o.backoff_max_s,
                                     uniform01(s));
    if (sl->deadline > 0 && now + wait >= sl->deadline) {
        char r[300];
        snprintf(r, sizeof r, "the call's deadline passed; last: %s", sl->reason);
        op_finish(b, sl, -ETIMEDOUT, r);
        return;
    }
    LOG_D(OS_TAG, "%s s3://%s/%s at %s: %s; attempt %u of %u in %.3f s", kind_name(op->kind),
          s->bucket, op->key ? op->key : "", s->endpoint, sl->reason, op->attempts + 1,
          s->o.max_attempts, wait);
    sl->phase = PH_BACKOFF;
    sl->backoff_until = now + wait;
}

static void slot_done(batch *b, slot *sl, double now)
{
    objstore_op *op = sl->op;
    os_xfer *x = &sl->x;
    int rc;
    int out = judge(b->s, sl, &rc);
    if (sl->phase == PH_MAIN) op->http_status = x->http_status;
    if (sl->phase == PH_VERIFY && out == OUT_FAIL && rc == -ENOENT) {
        snprintf(sl->reason, sizeof sl->reason, "the object is not there when HEAD checks "
                 "the PUT");
        rc = -EIO;
        out = OUT_RETRY;
    }
    if (out == OUT_OK && sl->phase == PH_VERIFY) {
        int plain = strlen(x->etag) == 32 && strspn(x->etag, "0123456789abcdefABCDEF") == 32;
        if ((uint64_t)x->content_length != op->put_len ||
            (plain && strcasecmp(x->etag, sl->md5_hex) != 0)) {
            snprintf(sl->reason, sizeof sl->reason, "HEAD after the PUT disagrees: %lld bytes, "
                     "ETag %.40s; sent %llu bytes, MD5 %s", (long long)x->content_length,
                     x->etag, (unsigned long long)op->put_len, sl->md5_hex);
            rc = -EIO;
            out = OUT_RETRY;
        }
    }
    if (out == OUT_RETRY) {
        retry_or_fail(b, sl, rc, now);
        return;
    }
    if (out == OUT_FAIL) {
        op_finish(b, sl, rc, sl->reason);
        return;
    }
    /* OK */
    switch (op->kind) {
    case OS_X_PUT:
        if (sl->phase == PH_MAIN) {
            slot_stop(b, sl);
            attempt_start(b, sl, PH_VERIFY, now);
            return;
        }
        op->size = (uint64_t)x->content_length;
        snprintf(op->etag, sizeof op->etag, "%s", x->etag);
        break;
    case OS_X_HEAD:
        op->size = (uint64_t)x->content_length;
        snprintf(op->etag, sizeof op->etag, "%s", x->etag);
        if (op->meta_name) snprintf(op->meta_value, sizeof op->meta_value, "%s", x->meta_out);
        break;
    case OS_X_GET:
        if (op->meta_name) snprintf(op->meta_value, sizeof op->meta_value, "%s", x->meta_out);
        snprintf(op->etag, sizeof op->etag, "%s", x->etag);
        if (x->get_whole) {
            if (!x->whole && !(x->whole = malloc(1))) {
                op_finish(b, sl, -ENOMEM, "out of memory");
                return;
            }
            x->whole[x->got] = 0;
            op->get_whole = x->whole;
            x->whole = NULL;
        }
        op->size = x->got;
        break;
    case OS_X_LIST:
        b->lr->truncated = x->list_truncated;
        snprintf(b->lr->next, sizeof b->lr->next, "%s", x->list_next);
        break;
    default:
        break;
    }
    op_finish(b, sl, 0, "");
}

/* Give the op in a fresh slot its MD5 (PUT) and first attempt. */
static void slot_begin(batch *b, slot *sl, double now, double deadline_abs)
{
    objstore_op *op = sl->op;
    sl->deadline = deadline_abs;
    sl->running = 0;
    if (op->kind == OS_X_LIST) sl->acc_mark = b->lr->acc->n;
    memset(&sl->x, 0, sizeof sl->x);
    if (op->kind == OS_X_PUT && b->h) {
        int t = take_md5(b, sl);
        if (t < 0) {
            op_finish(b, sl, b->h->rc[sl->op - b->ops], sl->reason);
            return;
        }
        if (t == 0) {
            sl->phase = PH_HASH; /* the loop starts it once the hasher got there */
            return;
        }
    } else if (op->kind == OS_X_PUT) {
        int rc = put_md5(b, sl);
        if (rc) {
            op_finish(b, sl, rc, sl->reason);
            return;
        }
        now = os_now_s();
    }
    attempt_start(b, sl, PH_MAIN, now);
}

static int run_batch(objstore *s, objstore_op *ops, size_t n, double deadline_s, list_req *lr)
{
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        objstore_op *op = &ops[i];
        op->rc = 0;
        op->http_status = 0;
        op->size = 0;
        op->etag[0] = 0;
        op->attempts = 0;
        op->why[0] = 0;
        if (op->kind == OBJSTORE_GET) op->get_whole = NULL;
        if (op->kind == OBJSTORE_GET || op->kind == OBJSTORE_HEAD) op->meta_value[0] = 0;
        if (op->kind == OS_X_LIST && lr) continue;
        int rc = validate_op(op, op->why, sizeof op->why);
        if (rc) {
            op->rc = rc;
            bad = 1;
        }
    }
    if (bad) {
        for (size_t i = 0; i < n; i++)
            if (!ops[i].rc) {
                ops[i].rc = -ECANCELED;
                log_why(ops[i].why, sizeof ops[i].why, "not run: another op of the batch is "
                        "malformed");
            }
        return -EINVAL;
    }
    double t0 = os_now_s();
    double deadline_abs = deadline_s > 0 ? t0 + deadline_s : 0;
    size_t nslots = n < s->o.max_in_flight ? n : s->o.max_in_flight;
    batch b = {s, NULL, lr, NULL, ops, NULL};
    slot *slots = nslots ? calloc(nslots, sizeof *slots) : NULL;
    int rc = nslots && !slots ? -ENOMEM : 0;
    if (!rc && nslots) rc = s->be->loop_open(s, &b.loop);
    if (rc) {
        for (size_t i = 0; i < n; i++) {
            ops[i].rc = rc;
            log_why(ops[i].why, sizeof ops[i].why, "%s s3://%s/%s at %s: no memory for the "
                    "transfers", kind_name(ops[i].kind), s->bucket, ops[i].key ? ops[i].key : "",
                    s->endpoint);
        }
        free(slots);
        return rc;
    }
    if (!lr) b.h = hasher_start(s, ops, n);
    size_t next = 0;
    for (;;) {
        double now = os_now_s();
        if (atomic_load(&s->cancel)) {
            for (size_t k = 0; k < nslots; k++)
                if (slots[k].op) op_finish(&b, &slots[k], -ECANCELED, "cancelled");
            for (; next < n; next++) {
                ops[next].rc = -ECANCELED;
                log_why(ops[next].why, sizeof ops[next].why, "%s s3://%s/%s at %s: cancelled "
                        "before it started", kind_name(ops[next].kind), s->bucket,
                        ops[next].key ? ops[next].key : "", s->endpoint);
            }
            break;
        }
        for (size_t k = 0; k < nslots && next < n; k++)
            if (!slots[k].op) {
                slots[k].op = &ops[next++];
                slot_begin(&b, &slots[k], now, deadline_abs);
                now = os_now_s();
            }
        int active = 0, running = 0;
        double wake = now + LOOP_TICK_S;
        for (size_t k = 0; k < nslots; k++) {
            slot *sl = &slots[k];
            if (!sl->op) continue;
            if (sl->running && sl->x.done) {
                slot_done(&b, sl, now);
            } else if (sl->running && deadline_abs > 0 && now >= deadline_abs) {
                slot_stop(&b, sl);
                char r[300];
                snprintf(r, sizeof r, "the call's deadline (%.1f s) passed during attempt %u",
                         deadline_s, sl->op->attempts);
                op_finish(&b, sl, -ETIMEDOUT, r);
            } else if (sl->running && now >= sl->x.deadline) {
                snprintf(sl->reason, sizeof sl->reason, "no complete answer within %.1f s",
                         s->o.request_timeout_s);
                retry_or_fail(&b, sl, -ETIMEDOUT, now);
            } else if (sl->running && now - sl->x.speed_t >= SLOW_WINDOW_S) {
                if (sl->x.moved - sl->x.speed_mark < SLOW_BYTES && s->o.signature == OBJSTORE_SIG_V2) {
                    snprintf(sl->reason, sizeof sl->reason, "fewer than %u bytes moved in %.0f s",
                             SLOW_BYTES, SLOW_WINDOW_S);
                    retry_or_fail(&b, sl, -ETIMEDOUT, now);
                } else {
                    sl->x.speed_mark = sl->x.moved;
                    sl->x.speed_t = now;
                }
            } else if (!sl->running && sl->phase == PH_BACKOFF && now >= sl->backoff_until) {
                attempt_start(&b, sl, PH_MAIN, now);
            } else if (!sl->running && sl->phase == PH_HASH) {
                int t = take_md5(&b, sl);
                if (t < 0) op_finish(&b, sl, b.h->rc[sl->op - ops], sl->reason);
                else if (t > 0) attempt_start(&b, sl, PH_MAIN, now);
                else if (deadline_abs > 0 && now >= deadline_abs)
                    op_finish(&b, sl, -ETIMEDOUT, "the call's deadline passed before its body "
                              "was hashed");
            }
            if (!sl->op) continue;
            active++;
            if (sl->running) {
                running++;
                if (sl->x.done) wake = now; /* finished at start: judge it at once */
                if (sl->x.deadline < wake) wake = sl->x.deadline;
            } else if (sl->phase == PH_BACKOFF && sl->backoff_until < wake) {
                wake = sl->backoff_until;
            }
        }
        if (!active && next >= n) break;
        if (deadline_abs > 0 && deadline_abs < wake) wake = deadline_abs;
        double t = wake - now;
        if (t < 0) t = 0;
        if (running) {
            s->be->wait(b.loop, t);
        } else if (t > 0) {
            struct timespec ts = {(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
    hasher_stop(b.h);
    if (b.loop) s->be->loop_close(s, b.loop);
    free(b.md5_buf);
    free(slots);
    for (size_t i = 0; i < n; i++)
        if (ops[i].rc) return ops[i].rc;
    return 0;
}

int objstore_run(objstore *s, objstore_op *ops, size_t n, double deadline_s)
{
    if (!s || (!ops && n)) return -EINVAL;
    return run_batch(s, ops, n, deadline_s, NULL);
}

void objstore_entries_free(objstore_entry *e, size_t n)
{
    if (!e) return;
    for (size_t i = 0; i < n; i++) free(e[i].key);
    free(e);
}

int objstore_list(objstore *s, const char *prefix, const char *delimiter, objstore_entry **out,
                  size_t *n, size_t max_entries, char *why, size_t why_len)
{
    if (why && why_len) why[0] = 0;
    if (!s || !out || !n) {
        log_why(why, why_len, "objstore_list: no handle or output");
        return -EINVAL;
    }
    *out = NULL;
    *n = 0;
    if (!prefix) prefix = "";
    size_t pl = strlen(prefix);
    if (pl > 1024 || (pl && strspn(prefix, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                           "0123456789._/-") != pl)) {
        log_why(why, why_len, "LIST s3://%s: the prefix must be [A-Za-z0-9._/-], at most 1024 "
                "bytes", s->bucket);
        return -EINVAL;
    }
    if (delimiter && (strlen(delimiter) != 1 || !strchr("/._-", delimiter[0]))) {
        log_why(why, why_len, "LIST s3://%s: the delimiter must be one of / . _ -", s->bucket);
        return -EINVAL;
    }
    os_list_acc acc = {NULL, 0, 0, max_entries ? max_entries : 1000000};
    char token[1100] = "";
    list_req lr = {prefix, delimiter, token, &acc, 0, ""};
    for (unsigned page = 0;; page++) {
        objstore_op op;
        memset(&op, 0, sizeof op);
        op.kind = OS_X_LIST;
        lr.token = token[0] ? token : NULL;
        lr.truncated = 0;
        lr.next[0] = 0;
        int rc = run_batch(s, &op, 1, 0, &lr);
        if (rc) {
            log_why(why, why_len, "%s", op.why);
            objstore_entries_free(acc.e, acc.n);
            return rc;
        }
        if (!lr.truncated) break;
        if (!lr.next[0] || !strcmp(lr.next, token) || page > 10000000) {
            log_why(why, why_len, "LIST s3://%s/%s* at %s: a truncated page without a usable "
                    "continuation marker", s->bucket, prefix, s->endpoint);
            objstore_entries_free(acc.e, acc.n);
            return -EBADMSG;
        }
        snprintf(token, sizeof token, "%s", lr.next);
    }
    *out = acc.e;
    *n = acc.n;
    return 0;
}
