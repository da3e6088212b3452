/* train-prepare: plain text files -> byte-level llm.c token shards with a validation split.
 * Exit status: 0 success, 1 runtime failure, 2 usage error. */
#include "data.h"
#include "log.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char usage_text[] =
    "usage: train-prepare --out DIR [--val-fraction F] [--format plain|brown] FILE...\n"
    "\n"
    "Turns text files into byte-level token shards (llm.c layout: 256 x int32 header with\n"
    "magic 20240520, version 1, token count; then uint16 tokens): DIR/train_000000.bin ... and\n"
    "DIR/val_000000.bin .... Documents are joined with a blank line.\n"
    "\n"
    "  --out DIR            output folder (created if missing), required\n"
    "  --val-fraction F     share of the files (spread evenly) held out for validation, in\n"
    "                       [0, 0.5]; with a single file, its last F of bytes (default 0.05)\n"
    "  --format FMT         plain (default): bytes as they are; brown: Brown corpus word/tag\n"
    "                       files, tags stripped, one sentence a line\n"
    "  -h, --help           this text\n";

int main(int argc, char **argv)
{
    static const struct option lo[] = {{"out", required_argument, 0, 'o'},
                                       {"val-fraction", required_argument, 0, 'v'},
                                       {"format", required_argument, 0, 'f'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
    const char *out = NULL;
    double frac = 0.05;
    int format = TRAIN_TEXT_PLAIN, c;
    while ((c = getopt_long(argc, argv, "o:v:f:h", lo, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case 'v': {
            char *end;
            errno = 0;
            frac = strtod(optarg, &end);
            if (errno || *end || end == optarg || !(frac >= 0 && frac <= 0.5)) {
                fprintf(stderr, "train-prepare: --val-fraction: '%s' is not a number in [0, 0.5]\n",
                        optarg);
                return 2;
            }
            break;
        }
        case 'f':
            if (!strcmp(optarg, "plain")) format = TRAIN_TEXT_PLAIN;
            else if (!strcmp(optarg, "brown")) format = TRAIN_TEXT_BROWN;
            else {
                fprintf(stderr, "train-prepare: --format: '%s' is not plain or brown\n", optarg);
                return 2;
            }
            break;
        case 'h': fputs(usage_text, stdout); return 0;
        default: fputs("train-prepare: see --help\n", stderr); return 2;
        }
    }
    if (!out || !out[0]) {
        fprintf(stderr, "train-prepare: --out DIR is required (see --help)\n");
        return 2;
    }
    struct stat ost;
    if (stat(out, &ost) == 0 && !S_ISDIR(ost.st_mode)) {
        fprintf(stderr, "train-prepare: --out %s: not a folder\n", out);
        return 2;
    }
    if (optind >= argc) {
        fprintf(stderr, "train-prepare: no input files (see --help)\n");
        return 2;
    }
    char why[512] = "";
    uint64_t nt = 0, nv = 0;
    int rc = train_prepare(out, (const char *const *)(argv + optind), (size_t)(argc - optind), frac,
                           format, &nt, &nv, why, sizeof why);
    if (rc < 0) {
        fprintf(stderr, "train-prepare: %s\n", why[0] ? why : strerror(-rc));
        return rc == -EINVAL ? 2 : 1;
    }
    printf("train-prepare: %d files -> %llu training tokens, %llu validation tokens in %s\n",
           argc - optind, (unsigned long long)nt, (unsigned long long)nv, out);
    return 0;
}
