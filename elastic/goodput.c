/* goodput.c - the goodput arithmetic (metrics.h, elastic_goodput_*): a pure fold over timed
 * events, kept apart from the agent so that a unit test can replay a recorded sequence.
 *
 * The timeline: cum[i] is the productive time of the steps base+1 .. base+1+i of the current
 * line of progress. A resume to step R (a round whose first step is R + 1) cuts the timeline
 * after R: what the cut steps took is recomputed time. Keeping the running sum per step makes
 * that exact for a resume to any step, at 8 bytes a step. */
#include "metrics.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define GP_MAX_STEPS ((size_t)1 << 22) /* then the oldest half is folded into `carried` */
#define GP_MAX_GAP ((int64_t)1 << 16)  /* a jump this far forward starts a new timeline */

static double top_cum(const elastic_goodput *g) { return g->n ? g->cum[g->n - 1] : 0.0; }

static int64_t top_step(const elastic_goodput *g) { return g->base + (int64_t)g->n; }

/* Fold the timeline into `carried` and start a new one after step `base`. */
static void restart_at(elastic_goodput *g, int64_t base)
{
    g->carried += top_cum(g);
    g->carried_steps += (int64_t)g->n;
    g->n = 0;
    g->base = base;
}

/* Append the next step, which took secs (the running sum is taken after a fold). */
static int push(elastic_goodput *g, double secs)
{
    if (g->n == GP_MAX_STEPS) { /* fold the oldest half */
        size_t half = g->n / 2;
        double folded = g->cum[half - 1];
        g->carried += folded;
        g->carried_steps += (int64_t)half;
        for (size_t i = half; i < g->n; i++) g->cum[i - half] = g->cum[i] - folded;
        g->n -= half;
        g->base += (int64_t)half;
    }
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 1024;
        double *c = realloc(g->cum, cap * sizeof *c);
        if (!c) return -ENOMEM;
        g->cum = c;
        g->cap = cap;
    }
    g->cum[g->n] = top_cum(g) + secs;
    g->n++;
    return 0;
}

/* Cut the timeline after step r (r < top): the cut completions become recomputed time. */
static void cut(elastic_goodput *g, int64_t r)
{
    double total = top_cum(g);
    if (r <= g->base) {
        g->recomputed_s += total; /* `carried` (steps before base) cannot be told apart: kept */
        g->n = 0;
        g->base = r;
        return;
    }
    size_t keep = (size_t)(r - g->base);
    g->recomputed_s += total - g->cum[keep - 1];
    g->n = keep;
}

static int add_step(elastic_goodput *g, const elastic_goodput_ev *ev)
{
    int64_t r = ev->step - 1; /* the step before this one */
    double secs = ev->seconds > 0 ? ev->seconds : 0.0;
    int first = !g->round_stepped;
    if (first) {
        g->round_stepped = 1;
        /* the restart window ends where this step began; a line of the interrupted round
         * read after the interruption (while its group stops) does not end it */
        if (g->win_open && g->win_restarting) {
            double t0 = ev->t - secs;
            if (t0 > g->win_t) g->restart_s += t0 - g->win_t;
            g->win_open = 0;
            g->win_restarting = 0;
            g->windows++;
        }
    }
    if (!g->timeline) {
        g->timeline = 1;
        g->base = r; /* the first step seen: the job started (or resumed) after r */
    }
    int64_t top = top_step(g);
    if (r < top) {
        if (first) {
            g->resumes++;
            g->steps_recomputed += top - r;
        } else {
            g->steps_recomputed += top - r; /* a step number that went back within a round */
        }
        cut(g, r);
    } else if (r > top) { /* lines were lost, or the job went on without this agent */
        if (r - top > GP_MAX_GAP) {
            restart_at(g, r);
        } else {
            for (int64_t s = top; s < r; s++)
                if (push(g, 0.0) < 0) {
                    restart_at(g, r); /* no memory for the gap: a new timeline */
                    break;
                }
        }
    }
    return push(g, secs);
}

int elastic_goodput_add(elastic_goodput *g, const elastic_goodput_ev *ev)
{
    if (g->ended) return 0;
    switch (ev->kind) {
    case ELASTIC_GP_START:
        g->t_start = ev->t;
        g->started = 1;
        return 0;
    case ELASTIC_GP_ROUND:
        g->round_stepped = 0;
        g->round_open = 1;
        if (g->win_open) g->win_restarting = 1;
        return 0;
    case ELASTIC_GP_STEP:
        if (ev->step < 0) return -EINVAL;
        return add_step(g, ev);
    case ELASTIC_GP_STALL:
        if (ev->seconds > 0) g->stall_s += ev->seconds;
        return 0;
    case ELASTIC_GP_INTERRUPT:
        g->interrupts++;
        g->round_open = 0;
        g->last_interrupt_t = ev->t;
        if (!g->win_open) {
            g->win_open = 1;
            g->win_restarting = 0;
            g->win_t = ev->t;
        }
        return 0;
    case ELASTIC_GP_END:
        g->t_end = ev->t;
        g->ended = 1;
        return 0;
    default: return -EINVAL;
    }
}

void elastic_goodput_get(const elastic_goodput *g, double now, elastic_goodput_report *r)
{
    memset(r, 0, sizeof *r);
    double end = g->ended ? g->t_end : now;
    r->wall_s = g->started && end > g->t_start ? end - g->t_start : 0.0;
    r->productive_s = g->carried + top_cum(g);
    r->recomputed_s = g->recomputed_s;
    r->restart_s = g->restart_s;
    r->restart_windows = g->windows;
    if (g->win_open && g->win_restarting) {
        /* new rounds started but none stepped: up to now while one runs, else to the last
         * one's interruption (what follows it is shutdown) */
        double until = g->round_open ? end : g->last_interrupt_t;
        if (until > g->win_t) r->restart_s += until - g->win_t;
        r->restart_windows++;
    }
    r->stall_s = g->stall_s;
    double other = r->wall_s - r->productive_s - r->recomputed_s - r->restart_s - r->stall_s;
    r->other_s = other > 0 ? other : 0.0;
    r->ratio = r->wall_s > 0 ? r->productive_s / r->wall_s : 0.0;
    if (r->ratio > 1) r->ratio = 1; /* only clock jitter between the workers' and ours */
    r->steps_recomputed = g->steps_recomputed;
    r->steps_kept = g->carried_steps + (int64_t)g->n;
    r->resumes = g->resumes;
    r->interrupts = g->interrupts;
}

void elastic_goodput_free(elastic_goodput *g)
{
    free(g->cum);
    *g = (elastic_goodput)ELASTIC_GOODPUT_INIT;
}

int elastic_goodput_compute(const elastic_goodput_ev *evs, size_t n, double end,
                            elastic_goodput_report *r)
{
    elastic_goodput g = ELASTIC_GOODPUT_INIT;
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        int e = elastic_goodput_add(&g, &evs[i]);
        if (e < 0 && rc == 0) rc = e;
    }
    elastic_goodput_get(&g, end, r);
    elastic_goodput_free(&g);
    return rc;
}
