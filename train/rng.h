/* rng.h - counter-based random numbers: every value is a pure function of (seed, stream,
 * counter), so results never depend on call order, thread or world size (DESIGN section 4).
 * The mixer is SplitMix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number
 * generators", OOPSLA 2014), applied to a combination of the three inputs. */
#ifndef TRAIN_RNG_H
#define TRAIN_RNG_H

#include <math.h>
#include <stdint.h>

static inline uint64_t train_rng_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* 64 random bits for (seed, stream, counter). */
static inline uint64_t train_rng_u64(uint64_t seed, uint64_t stream, uint64_t counter)
{
    return train_rng_mix(train_rng_mix(seed ^ train_rng_mix(stream)) + counter);
}

/* Uniform double in (0, 1). */
static inline double train_rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter)
{
    return ((double)(train_rng_u64(seed, stream, counter) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* Standard normal (Box-Muller over two counters). */
static inline double train_rng_normal(uint64_t seed, uint64_t stream, uint64_t counter)
{
    double u1 = train_rng_uniform(seed, stream, 2 * counter);
    double u2 = train_rng_uniform(seed, stream, 2 * counter + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

#endif /* TRAIN_RNG_H */
