/* objstore_internal.h - what objstore.c (settings, credentials, retries, the scheduler)
 * shares with its two signers, objstore_v4.c (libcurl) and objstore_v2.c (libs3 2.0).
 *
 * The seam: a backend runs one attempt of one request (an os_xfer) inside a loop object
 * that the scheduler drives with a bounded wait. It reports what came back (HTTP status,
 * S3 error code, transport error, headers, body bytes through the os_* helpers) and never
 * decides about retries; objstore.c judges every finished attempt the same way for both
 * signers, which is why the checks libs3 lacks (short GET bodies, PUTs it wrongly calls
 * successful) live there.
 */
#ifndef OBJSTORE_INTERNAL_H
#define OBJSTORE_INTERNAL_H

#include "objstore.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#define OS_TAG "objstore"

/* Credentials of one attempt (copied, so that a re-read file never changes them mid-way). */
typedef struct os_creds {
    char key_id[128];
    char secret[256];
    char token[4096];
} os_creds;

typedef struct os_backend os_backend;

struct objstore {
    objstore_opts o;
    char bucket[64];
    char prefix[1024];
    char endpoint[320]; /* "http://host:port", for messages and URLs */
    char host[300];     /* "host[:port]" as it goes into the Host header */
    int https;
    int path_style;     /* 1: http(s)://host/bucket/key; 0: http(s)://bucket.host/key */
    char region[64];

    pthread_mutex_t mu; /* guards cr, cred_* */
    os_creds cr;
    int creds_from_file;
    char cred_path[1024];
    char profile[128];
    int cred_have_st;
    dev_t cred_dev;
    ino_t cred_ino;
    off_t cred_size;
    struct timespec cred_mtim, cred_ctim;
    int cred_warned;

    atomic_int cancel;
    atomic_ullong rng;
    const os_backend *be;
    void *be_state; /* the backend's own (V4: a pool of curl multi handles) */
};

enum os_xkind { OS_X_PUT = 1, OS_X_GET = 2, OS_X_HEAD = 3, OS_X_DELETE = 4, OS_X_LIST = 5 };

/* The entries of a listing collected so far (all pages). */
typedef struct os_list_acc {
    objstore_entry *e;
    size_t n, cap, max;
} os_list_acc;

/* One attempt of one request. The scheduler fills the inputs and zeroes the results before
 * each attempt; the backend fills the results and sets done. */
typedef struct os_xfer {
    objstore *s;
    int kind; /* enum os_xkind */
    const char *key;
    os_creds cr;

    /* PUT */
    const unsigned char *put_data;
    int put_fd;
    uint64_t put_offset, put_len, put_pos;
    char md5_b64[32];
    const char *meta_name;  /* PUT: header to send; GET/HEAD: header to return */
    const char *meta_value; /* PUT */

    /* GET: ranged into get_buf, or whole into a growing buffer */
    int get_whole;
    unsigned char *get_buf;
    uint64_t get_offset, get_len, get_max;
    char *whole;
    uint64_t whole_cap;
    uint64_t got; /* body bytes received */

    /* LIST: one page */
    const char *list_prefix, *list_delim, *list_token;
    unsigned list_max_keys;
    os_list_acc *acc;
    int list_truncated;
    char list_next[1100]; /* V4: NextContinuationToken; V2: the next marker */
    char *body;           /* V4: answer bodies that are parsed (listing, error document) */
    size_t body_len, body_cap;

    /* results */
    int done;
    int http_status;   /* 0: no answer */
    int transport;     /* -errno of a transport failure (http_status 0) */
    int curl_code;     /* the CURLcode, -1 for a libs3 transport status */
    int local_err;     /* a failure this side decided (body too long, pread error, ...) */
    int local_retry;   /* 1: local_err may be retried */
    int error_doc_2xx; /* a 2xx answer carried an error document */
    int parse_failed;  /* LIST: a 2xx answer that is not a listing */
    char code[64];     /* S3 error code ("" when none) */
    char msg[160];     /* the S3 message, or the transport error's text */
    char etag[72];
    int64_t content_length; /* -1 unknown */
    int64_t range_total;    /* from Content-Range ".../TOTAL"; -1 unknown */
    int range_seen;         /* a 206 / Content-Range came */
    char meta_out[128];

    /* timing (scheduler) */
    double deadline;     /* absolute (os_now_s) end of this attempt */
    uint64_t moved;      /* body bytes in either direction (V2 low-speed rule) */
    uint64_t speed_mark; /* moved at speed_t */
    double speed_t;

    void *be; /* the backend's per-attempt state */
} os_xfer;

typedef struct os_loop os_loop;

struct os_backend {
    const char *name;
    int (*init)(objstore *s);
    void (*fini)(objstore *s);
    /* A loop for one objstore_run / objstore_list call, on the calling thread. */
    int (*loop_open)(objstore *s, os_loop **out);
    void (*loop_close)(objstore *s, os_loop *l);
    /* Begin the attempt x. 0, or -errno with x->done set and the reason filled. */
    int (*start)(os_loop *l, os_xfer *x);
    /* Release x's attempt whether it finished or not (an unfinished one is aborted). */
    void (*stop)(os_loop *l, os_xfer *x);
    /* Move data for up to timeout_s seconds; sets done on the attempts that finished. */
    void (*wait)(os_loop *l, double timeout_s);
};

extern const os_backend os_backend_v4;
extern const os_backend os_backend_v2;

/* Monotonic seconds. */
double os_now_s(void);

/* Next bytes of a PUT body (pread or copy) into buf: count, 0 at the end, or -errno (then
 * x->local_err is set). */
long os_put_read(os_xfer *x, void *buf, size_t n);

/* Body bytes of a GET answer: 0, or -1 to abort the transfer (x->local_err says why: a body
 * longer than asked, or past get_max). */
int os_get_write(os_xfer *x, const void *p, size_t n);

/* Append a listing entry (key copied): 0, -ENOMEM, -EFBIG (past acc->max; x->local_err). */
int os_list_add(os_xfer *x, const char *key, uint64_t size, const char *etag, int is_prefix);

/* Read <Code> and <Message> of an S3 error document into x->code / x->msg (libxml2).
 * 1 when the text is an <Error> document, else 0. */
int os_parse_error_doc(os_xfer *x, const char *body, size_t len);

/* Copy an ETag without its quotes. */
void os_copy_etag(char *dst, size_t dst_len, const char *src, size_t n);

/* Process-wide start-up of libcurl, libxml2 and libs3 (once). 0 or -ENOMEM / -EIO. */
int os_global_init(void);

#endif /* OBJSTORE_INTERNAL_H */
