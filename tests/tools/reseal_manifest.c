/* reseal_manifest FILE: recompute the manifest_xxh3 member of a (tampered) manifest.json so
 * that tests can reach the checks behind the checksum (docs/FORMAT.md, "Manifest checksum").
 * Exit 0 done, 1 failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: reseal_manifest FILE\n");
        return 1;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    static char buf[64 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *key = ",\"manifest_xxh3\":\"";
    char *last = NULL;
    for (char *p = buf; (p = strstr(p, key)) != NULL; p++) last = p;
    if (!last || (size_t)(last - buf) + strlen(key) + 16 > n) {
        fprintf(stderr, "%s: no manifest_xxh3 member\n", argv[1]);
        return 1;
    }
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits(buf, (size_t)(last - buf)));
    memcpy(last + strlen(key), hex, 16);
    f = fopen(argv[1], "wb");
    if (!f || fwrite(buf, 1, n, f) != n || fclose(f) != 0) {
        perror(argv[1]);
        return 1;
    }
    return 0;
}
