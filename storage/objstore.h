/* objstore.h - an S3-compatible object store client: put, ranged get, head, delete, list,
 * each with a deadline and bounded retries. Knows nothing about snapshots.
 *
 * Two signers behind one interface (objstore_opts.signature):
 *   OBJSTORE_SIG_V4 (default): libcurl's CURLOPT_AWS_SIGV4 ("aws:amz:<region>:s3"), with the
 *     caller-set x-amz-content-sha256: UNSIGNED-PAYLOAD (curl 7.88 honours it, curl PR #9804)
 *     and Content-MD5 for integrity; AWS_SESSION_TOKEN is sent as x-amz-security-token.
 *     Every AWS region, Cloudflare R2, Backblaze B2, Ceph RGW and MinIO accept it.
 *   OBJSTORE_SIG_V2: libs3 2.0 (signature version 2; no session tokens). Kept for old
 *     S3-compatible servers that do not speak V4.
 * Requests are driven by this module's own loop (curl multi / libs3 request contexts with
 * their fd sets), so every attempt has a deadline: libs3 2.0 has none of its own. V2: the
 * connect timeout is not enforced separately (libs3 has no hook for it); the request
 * timeout and the low-speed rule (below) bound a silent connection instead. libs3 2.0 does
 * not report HTTP statuses either: with V2, objstore_op.http_status is the status its
 * S3Status implies (an error it does not name counts as 500).
 *
 * Settings, read at objstore_open the way the AWS CLI reads them:
 *   AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL: "http[s]://host[:port]" of an S3-compatible
 *     server; path-style addressing is then used. Unset: https://s3.<region>.amazonaws.com,
 *     virtual-host style.
 *   AWS_REGION, else AWS_DEFAULT_REGION, else "us-east-1".
 *   AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN): when both are set they
 *     win; else the shared credentials file AWS_SHARED_CREDENTIALS_FILE (default
 *     ~/.aws/credentials), section AWS_PROFILE (default "default"), keys aws_access_key_id,
 *     aws_secret_access_key, aws_session_token. The file is stat-ed before every attempt and
 *     re-read when its inode, size or modification time changed, so a rotated key is picked
 *     up without a restart.
 * No secret (secret key, session token) is ever written to a log line, an error text
 * (objstore_op.why) or anything this module returns.
 *
 * Integrity: a PUT sends Content-MD5 (the server refuses a body that does not match), then
 * HEADs the key and compares the size and, where the ETag is a plain MD5 (single-part PUT),
 * the ETag with what was sent; a 200 answer carrying an XML <Error> document is a failure. A
 * GET must deliver exactly the bytes asked for (a short or long body is retried).
 *
 * Retries (objstore_retryable): connection failures (refused, reset, timed out, DNS,
 * the TLS handshake; not a certificate that fails verification), HTTP 408, 429, 500, 502,
 * 503, 504 and any other 5xx, and the S3 error codes InternalError, SlowDown,
 * RequestTimeout, RequestTimeTooSkewed, ServiceUnavailable, Throttling,
 * ThrottlingException, RequestThrottled, BadDigest and IncompleteBody (the body was damaged
 * or cut on the way), whatever the status they come with; and a body cut short, a 2xx with
 * an error document, or a PUT whose HEAD check disagrees. Backoff: "full jitter" (AWS Architecture Blog, "Exponential Backoff
 * And Jitter", 2015): before attempt k+1 sleep uniform(0, min(backoff_max_s,
 * backoff_base_s * 2^k)). Everything else (403 AccessDenied / InvalidAccessKeyId /
 * SignatureDoesNotMatch, 404 NoSuchBucket, 400) fails at once with a one-line why naming the
 * endpoint, bucket and key.
 *
 * Errors (negative errno codes; none of them ever means "the bytes are corrupt": that is for
 * the caller to judge from checksums):
 *   -ENOENT     404 NoSuchKey (GET, HEAD); DELETE of a missing key is success
 *   -ENXIO      404 NoSuchBucket
 *   -EACCES     403 (bad credentials, signature mismatch, access denied) or no credentials
 *   -EINVAL     bad arguments, or a 400 answer other than the retryable ones
 *   -ETIMEDOUT  the attempts' deadlines or the call's deadline passed
 *   -ECONNREFUSED, -ECONNRESET, -EHOSTUNREACH  transport failures after the last attempt
 *   -EIO        5xx / throttling after the last attempt, a short body, an error document,
 *               a PUT whose HEAD check disagreed, another 4xx (405, 409, 412, ...)
 *   -ERANGE     GET: the range runs past the end of the object (416 InvalidRange, or an
 *               answer that announces fewer bytes than asked for); not retried
 *   -EFBIG      GET whole: the object is larger than get_max
 *   -ECANCELED  objstore_cancel was called
 *   -ENOMEM
 *
 * Thread-safety: an objstore handle may be used by several threads at once (each call has
 * its own transfers; the credentials are guarded by a mutex). objstore_cancel may be called
 * from any thread, also a signal-free one while others are inside calls.
 */
#ifndef OBJSTORE_H
#define OBJSTORE_H

#include <stddef.h>
#include <stdint.h>

enum objstore_signature { OBJSTORE_SIG_V4 = 4, OBJSTORE_SIG_V2 = 2 };

typedef struct objstore_opts {
    const char *url;          /* "s3://bucket[/prefix]"; bucket 3..63 of [a-z0-9.-], prefix of
                                 [A-Za-z0-9._/-] without leading, trailing or double slashes */
    int signature;            /* enum objstore_signature; 0 = default (V4) */
    double connect_timeout_s; /* per attempt, to connect; default 5 */
    double request_timeout_s; /* per attempt, whole request; default 60. A transfer that moves
                                 fewer than 1 KiB/s for 10 s is also cut (then retried) */
    unsigned max_attempts;    /* per request, first try included; default 6, range [1, 100] */
    double backoff_base_s;    /* default 0.2 */
    double backoff_max_s;     /* default 10 */
    unsigned max_in_flight;   /* requests objstore_run keeps in flight; default 8, [1, 256] */
    unsigned list_page_keys;  /* keys asked per listing page (max-keys); default 1000, the
                                 most servers give, [1, 1000] */
} objstore_opts;

/* A field left 0 (other than url) takes its default, so a zeroed struct works too. */
#define OBJSTORE_OPTS_INIT {NULL, 0, 5.0, 60.0, 6u, 0.2, 10.0, 8u, 1000u}

typedef struct objstore objstore;

/* Parse the URL, read the settings and credentials (above) and return a handle in *out.
 * opts is copied. On failure why (if not NULL) gets one line (never a secret).
 * Errors: -EINVAL bad URL, endpoint or options; -EACCES no credentials found (the line says
 * where it looked); -ENOMEM. */
int objstore_open(objstore **out, const objstore_opts *opts, char *why, size_t why_len);

/* Free; accepts NULL. No call may be in progress. */
void objstore_close(objstore *s);

/* Make every call in progress and to come fail soon with -ECANCELED (within about 100 ms).
 * Thread-safe; accepts NULL. */
void objstore_cancel(objstore *s);

/* Parts of the URL and settings, owned by the handle: the bucket, the prefix ("" when none;
 * never with a trailing slash), the endpoint for messages ("http://127.0.0.1:7480" or
 * "https://s3.us-east-1.amazonaws.com") and the signature in use. */
const char *objstore_bucket(const objstore *s);
const char *objstore_prefix(const objstore *s);
const char *objstore_endpoint(const objstore *s);
int objstore_signature(const objstore *s);

enum objstore_kind { OBJSTORE_PUT = 1, OBJSTORE_GET = 2, OBJSTORE_HEAD = 3, OBJSTORE_DELETE = 4 };

/* One request of a batch. The caller fills the inputs; objstore_run fills the results. Keys
 * are full keys within the bucket (the caller adds objstore_prefix) of [A-Za-z0-9._/-],
 * 1..1024 bytes, without a leading slash, an empty segment ("a//b") or a "." or ".."
 * segment (curl would fold those and reach another object). */
typedef struct objstore_op {
    int kind;                 /* enum objstore_kind */
    const char *key;
    /* PUT: the body comes from put_data (put_len bytes) when not NULL, else from the file
     * descriptor put_fd at offset put_offset (pread; the descriptor is not moved, and may be
     * shared by ops of the same batch). */
    const void *put_data;
    int put_fd;
    uint64_t put_offset, put_len;
    const char *meta_name;    /* PUT: one x-amz-meta-<meta_name> header ([a-z0-9-]{1,64}) with
                                 meta_value, when not NULL. GET/HEAD: the value of that header
                                 is returned in meta_value (empty when absent) */
    char meta_value[128];     /* PUT: input (printable ASCII); GET/HEAD: output */
    /* GET: bytes [get_offset, get_offset + get_len) into get_buf (get_len bytes, caller-owned).
     * get_len 0 with get_buf NULL: the whole object into a malloc'ed buffer returned in
     * get_whole (caller frees; a NUL is appended; at most get_max bytes, 1..2^40, else
     * -EFBIG). Any other combination is -EINVAL. */
    void *get_buf;
    uint64_t get_offset, get_len;
    uint64_t get_max;
    char *get_whole;
    /* results */
    int rc;                   /* 0 or a negative errno (see the top of this file) */
    int http_status;          /* of the last attempt; 0 when no answer came */
    uint64_t size;            /* HEAD: the object's size; PUT: the size confirmed by HEAD;
                                 GET whole: bytes in get_whole */
    char etag[72];            /* HEAD, and PUT (from its HEAD): the ETag without quotes */
    unsigned attempts;        /* attempts made */
    char why[320];            /* on failure: one line naming the operation, endpoint, bucket,
                                 key and the reason (S3 error code, HTTP status, curl error) */
} objstore_op;

/* Run n requests with up to max_in_flight in flight, each retried as above, in the order
 * given (ops are started in array order: give ranged GETs ordered by offset). Waits for all
 * of them; a request whose deadline (now + deadline_s; <= 0: none beyond the per-attempt
 * limits) passes gets -ETIMEDOUT (also when the next backoff would end past it). Returns 0
 * when every op succeeded, else the rc of the first failed op in array order (each op has
 * its own rc and why). A PUT first reads its body once for the MD5, then streams it.
 * Errors: -EINVAL s or ops NULL, or a malformed op (that op's rc and why say which; then no
 * op of the batch runs, and the others get -ECANCELED). */
int objstore_run(objstore *s, objstore_op *ops, size_t n, double deadline_s);

/* One entry of a listing. */
typedef struct objstore_entry {
    char *key;                /* full key, or a common prefix ending in the delimiter */
    uint64_t size;            /* 0 for a common prefix */
    int is_prefix;            /* 1: a common prefix (with a delimiter) */
    char etag[72];
} objstore_entry;

/* List the keys under `prefix` (may be "" or NULL; [A-Za-z0-9._/-]), with ListObjects (V2
 * signer: libs3's ListBucket; V4: ListObjectsV2), list_page_keys keys a page, following
 * continuation markers, each page retried as objstore_run retries. Entries come in the
 * server's order (by key). With delimiter (one of "/", ".", "_", "-") the
 * keys below the next delimiter are folded into common prefixes. The caller frees the array
 * with objstore_entries_free. At most max_entries entries (-EFBIG past it; 0 = 1,000,000).
 * Errors: as objstore_run, and -EBADMSG (an answer that is not a listing: never about
 * snapshots). */
int objstore_list(objstore *s, const char *prefix, const char *delimiter, objstore_entry **out,
                  size_t *n, size_t max_entries, char *why, size_t why_len);

void objstore_entries_free(objstore_entry *e, size_t n);

/* --- pure helpers, exposed for tests --- */

/* Split "s3://bucket/prefix" into bucket and prefix (trailing slash dropped). 0 or -EINVAL
 * (why says what is wrong). */
int objstore_parse_url(const char *url, char *bucket, size_t bucket_len, char *prefix,
                       size_t prefix_len, char *why, size_t why_len);

/* 1 when an attempt that ended so should be retried: http_status 0 means no answer
 * (transport failure; curl_code is then the CURLcode, or -1 for a libs3 transport status),
 * s3_code is the <Code> of the error document or NULL. */
int objstore_retryable(int http_status, const char *s3_code, int curl_code);

/* Full-jitter backoff before attempt `attempt` + 1 (attempt >= 1), in seconds, from a
 * uniform number u in [0, 1). */
double objstore_backoff_s(unsigned attempt, double base_s, double max_s, double u);

/* Parse the shared credentials file text for `profile`: key id, secret and token (empty
 * when absent) into the caller's buffers. 0, -ENOENT (no such profile or no key in it),
 * -EINVAL (key too long), -EILSEQ (a value with a control character: it would end up in an
 * HTTP header). */
int objstore_parse_credentials(const char *text, const char *profile, char *key_id,
                               size_t key_id_len, char *secret, size_t secret_len, char *token,
                               size_t token_len);

#endif /* OBJSTORE_H */
