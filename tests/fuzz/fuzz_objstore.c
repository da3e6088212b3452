/* fuzz_objstore.c - libFuzzer harness: what the object store client (storage/objstore.h)
 * parses from outside: s3:// URLs (a flag), the shared credentials file (a file anyone with
 * access to the node may edit) and S3 error documents (a server's answer, DESIGN I5).
 *
 * The first input byte selects the parser, the rest is its input:
 *   0: objstore_parse_url - on success the bucket is 3..63 of [a-z0-9.-] and the prefix only
 *      [A-Za-z0-9._/-] with no leading, trailing or doubled slash (objstore.h);
 *   1: objstore_parse_credentials for profile "default" and for a profile named by the
 *      input's first line - outputs NUL-terminated within their buffers, 0 only with a key
 *      id and a secret, and no value with a control character accepted;
 *   2: os_parse_error_doc (libxml2) - code and message NUL-terminated within their fields.
 * Any crash, sanitizer report or leak is a finding, as is a broken promise above (FZ_ASSERT).
 */
#include "fz_util.h"
#include "objstore.h"
#include "objstore_internal.h"

static int only(const char *s, const char *set) { return strspn(s, set) == strlen(s); }

static void check_url(const char *text)
{
    char bucket[64], prefix[1100], why[256];
    memset(bucket, 'x', sizeof bucket);
    memset(prefix, 'x', sizeof prefix);
    why[0] = '\0';
    int rc = objstore_parse_url(text, bucket, sizeof bucket, prefix, sizeof prefix, why, sizeof why);
    FZ_ASSERT(memchr(why, '\0', sizeof why) != NULL, "why not terminated");
    if (rc != 0) {
        FZ_ASSERT(rc == -EINVAL, "rc %d", rc);
        FZ_ASSERT(why[0] != '\0', "a refusal without a reason");
        return;
    }
    size_t bl = strnlen(bucket, sizeof bucket), pl = strnlen(prefix, sizeof prefix);
    FZ_ASSERT(bl >= 3 && bl <= 63 && only(bucket, "abcdefghijklmnopqrstuvwxyz0123456789.-"),
              "bucket '%.70s'", bucket);
    FZ_ASSERT(pl < sizeof prefix, "prefix not terminated");
    FZ_ASSERT(only(prefix, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/-"),
              "prefix '%.100s'", prefix);
    FZ_ASSERT(pl == 0 || (prefix[0] != '/' && prefix[pl - 1] != '/' && !strstr(prefix, "//")),
              "prefix '%.100s'", prefix);
}

static void check_creds(const char *text, const char *profile)
{
    char id[128], secret[128], token[2048];
    memset(id, 'x', sizeof id);
    memset(secret, 'x', sizeof secret);
    memset(token, 'x', sizeof token);
    int rc = objstore_parse_credentials(text, profile, id, sizeof id, secret, sizeof secret,
                                        token, sizeof token);
    FZ_ASSERT(rc == 0 || rc == -ENOENT || rc == -EINVAL || rc == -EILSEQ, "rc %d", rc);
    if (rc == 0) {
        FZ_ASSERT(memchr(id, '\0', sizeof id) && memchr(secret, '\0', sizeof secret) &&
                  memchr(token, '\0', sizeof token), "outputs not terminated");
        FZ_ASSERT(id[0] && secret[0], "success without a key id and a secret");
        for (const char *p = token; *p; p++)
            FZ_ASSERT((unsigned char)*p >= 0x20 && *p != 0x7f, "a control character in the token");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)
{
    if (n < 1 || n > 65536) return 0;
    char *text = malloc(n);
    FZ_SETUP(text != NULL, "malloc");
    memcpy(text, d + 1, n - 1);
    text[n - 1] = '\0'; /* the parsers take C strings; an embedded NUL ends the text */
    switch (d[0] % 3) {
    case 0: check_url(text); break;
    case 1: {
        check_creds(text, "default");
        char profile[64];
        size_t k = strcspn(text, "\n");
        snprintf(profile, sizeof profile, "%.*s", (int)(k < 63 ? k : 63), text);
        if (profile[0]) check_creds(text, profile);
        break;
    }
    default: {
        os_xfer x;
        memset(&x, 0, sizeof x);
        int r = os_parse_error_doc(&x, (const char *)d + 1, n - 1);
        FZ_ASSERT(r == 0 || r == 1, "r %d", r);
        FZ_ASSERT(memchr(x.code, '\0', sizeof x.code) && memchr(x.msg, '\0', sizeof x.msg),
                  "code or message not terminated");
        break;
    }
    }
    free(text);
    return 0;
}
