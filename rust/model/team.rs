//! The step team: every kernel thread held for one small decoder call, sharing its products.
//!
//! A decode step of a small model at one sequence is ~150 products of 10-100 us each. Handing
//! each one to rayon wakes a parked worker every time (tens of microseconds, more than
//! the product's share it then runs). Instead the call runs on one thread (the leader) while the
//! others (helpers) stay in a claim loop for the call: the leader publishes each product, and
//! leader and helpers claim its column jobs from one atomic counter until none are left, so a
//! helper that the OS has descheduled costs only the job it holds, never a wait for it to wake.
//! An idle helper spins a little, then yields its core on every turn (`sched_yield`), and leaves
//! after `IDLE_LEAVE` without work; the leader never waits for a helper to arrive.
//!
//! Claim word (one `AtomicU64`, all operations SeqCst): `generation << 32 | jobs << 16 | next`.
//! The leader publishes a product by storing its pointer, resetting `done`, then the word with a
//! new generation; a claim is a compare-exchange of `next` to `next + 1` under the same
//! generation, so a helper that read a product pointer of another generation can never run a
//! job of it. The leader reuses the slot only after `done == jobs`.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::linear::Product;

/// Jobs of one product fit the claim word's 16-bit fields.
const MAX_JOBS: usize = u16::MAX as usize;
/// Busy turns of an idle helper before it starts yielding its core.
const SPIN_TURNS: u32 = 256;
/// An idle helper leaves the team after this long without work. A helper that left cannot rejoin
/// the call, so this outlasts any serial stretch of the leader inside a step (a few milliseconds
/// of norms, copies and page faults at 32 rows of a large vocabulary): shorter, the rest of the
/// step's products ran on the leader alone.
const IDLE_LEAVE: Duration = Duration::from_millis(20);

/// The state a step's threads share (see the module docs).
pub struct Team {
    word: AtomicU64,
    product: AtomicPtr<()>,
    done: AtomicUsize,
    finished: AtomicBool,
    threads: usize,
}

impl Team {
    fn new(threads: usize) -> Self {
        Team {
            word: AtomicU64::new(0),
            product: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
            threads,
        }
    }

    /// Threads in the team (for sizing jobs).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run every job of `p` with whichever helpers are there; returns when all are done.
    pub fn run(&self, p: &Product) -> Result<()> {
        let jobs = p.jobs();
        if jobs > MAX_JOBS {
            return Err(Error::Invalid(format!(
                "a team product has at most {MAX_JOBS} jobs, got {jobs}"
            )));
        }
        if jobs == 0 {
            return Ok(());
        }
        let generation = (self.word.load(SeqCst) >> 32).wrapping_add(1) & 0xffff_ffff;
        self.product.store(p as *const Product as *mut (), SeqCst);
        self.done.store(0, SeqCst);
        self.word.store(generation << 32 | (jobs as u64) << 16, SeqCst);
        // SAFETY: `p` is the product just published under `generation`; it outlives this call,
        // which returns only once every job has been run.
        unsafe { self.claim_all(generation, p) };
        let mut turns = 0u32;
        while self.done.load(SeqCst) < jobs {
            // A helper holds the last job: spin, then yield in case it waits for this core.
            turns += 1;
            if turns < SPIN_TURNS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Claim and run jobs of `p` while `generation`'s counter has any left (`p` is dereferenced
    /// only after a claim succeeds).
    ///
    /// # Safety
    /// `p` was read from `self.product` after `generation` was read from the word (or is the
    /// leader's own product of that generation): whenever a claim of `generation` succeeds, `p`
    /// is then the live product of that generation (see the module docs).
    unsafe fn claim_all(&self, generation: u64, p: *const Product) {
        let mut w = self.word.load(SeqCst);
        loop {
            let (jobs, next) = ((w >> 16) & 0xffff, w & 0xffff);
            if w >> 32 != generation || next >= jobs {
                return;
            }
            match self.word.compare_exchange(w, w + 1, SeqCst, SeqCst) {
                Ok(_) => {
                    // SAFETY: job `next` of this generation was claimed by this thread alone
                    // (the counter moved past it), `next < jobs`, and `p` is live (contract).
                    unsafe { (*p).run(next as usize) };
                    self.done.fetch_add(1, SeqCst);
                    w += 1;
                }
                Err(cur) => w = cur,
            }
        }
    }

    /// A helper's loop: claim jobs of whatever product is published until the call is finished.
    fn help(&self) {
        let mut idle_since: Option<Instant> = None;
        let mut turns = 0u32;
        while !self.finished.load(SeqCst) {
            let w = self.word.load(SeqCst);
            let (jobs, next) = ((w >> 16) & 0xffff, w & 0xffff);
            if next < jobs {
                let ptr = self.product.load(SeqCst) as *const Product;
                // SAFETY: the word was read before the pointer; a claim succeeds only while the
                // word still holds that generation with jobs left, and the leader replaces the
                // pointer only after every job of its generation is claimed and done, so any job
                // this thread runs belongs to the product `ptr` points to, alive until `done`
                // counts it.
                unsafe { self.claim_all(w >> 32, ptr) };
                idle_since = None;
                turns = 0;
                continue;
            }
            // Any rayon job the leader's own parallel loops (attention) left.
            if rayon::yield_now() == Some(rayon::Yield::Executed) {
                idle_since = None;
                turns = 0;
                continue;
            }
            turns += 1;
            if turns < SPIN_TURNS {
                std::hint::spin_loop();
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() > IDLE_LEAVE {
                return;
            }
            // Give the core to whoever else wants it.
            std::thread::yield_now();
        }
    }
}

/// How long the pool's threads stay awake after a team call, waiting for the next one (a decode
/// step's Python part between two calls takes a fraction of a millisecond). A parked rayon worker
/// takes tens of microseconds to start the next call's leader and longer to bring its helper in,
/// while the leader runs the step's first products alone; lingering removes that wait, which
/// shortens one-sequence decode steps most.
const LINGER: Duration = Duration::from_micros(1500);

/// Team calls begun; a lingering worker leaves as soon as it changes.
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Run `f(team)` on one thread of `pool` while its other threads help with the team's products
/// (see the module docs). With one thread, `f` runs alone. Afterwards every thread of `pool`
/// stays awake for up to `LINGER` (running any job the pool is given meanwhile, yielding its core
/// otherwise) and leaves as soon as the next team call begins.
pub fn with_team<R: Send>(pool: &rayon::ThreadPool, f: impl FnOnce(&Team) -> R + Send) -> R {
    let call = CALLS.fetch_add(1, SeqCst) + 1;
    let r = run_team(pool, f);
    if pool.current_num_threads() > 1 {
        pool.spawn_broadcast(move |_| {
            let since = Instant::now();
            while CALLS.load(SeqCst) == call && since.elapsed() < LINGER {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::thread::yield_now();
                }
            }
        });
    }
    r
}

/// `with_team` without the lingering afterwards.
fn run_team<R: Send>(pool: &rayon::ThreadPool, f: impl FnOnce(&Team) -> R + Send) -> R {
    let threads = pool.current_num_threads();
    let team = Team::new(threads);
    let leader = Mutex::new(Some(f));
    let out = Mutex::new(None);
    pool.broadcast(|ctx| {
        if ctx.index() == 0 {
            let f = leader.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(f) = f {
                let r = f(&team);
                team.finished.store(true, SeqCst);
                *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            }
        } else {
            team.help();
        }
    });
    match out.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(r) => r,
        None => unreachable!("broadcast runs index 0 once"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::{self, QWeight};
    use crate::runtime;
    use crate::testing::Rng;

    #[test]
    fn the_pool_runs_other_jobs_and_team_calls_right_after_a_team_call() {
        let pool = runtime::build_pool(2).unwrap();
        for round in 0..20u64 {
            assert_eq!(with_team(&pool, |team| team.threads() as u64 + round), 2 + round);
            // The lingering workers take this job (or leave for the next team call).
            let sum: u64 = pool.install(|| {
                use rayon::prelude::*;
                (0..1000u64).into_par_iter().map(|i| i * round).sum()
            });
            assert_eq!(sum, 499_500 * round);
        }
    }

    #[test]
    fn team_products_equal_linear_for_any_thread_count() {
        let mut r = Rng(0x7ea4);
        let isa = runtime::detected_isa();
        for threads in [1, 2, 3, 5] {
            let pool = runtime::build_pool(threads).unwrap();
            let ws: Vec<QWeight> = [(40, 64), (700, 32), (16, 96)]
                .iter()
                .map(|&(n, k)| {
                    let w: Vec<f32> = (0..n * k).map(|_| r.uniform()).collect();
                    QWeight::from_f32(&w, n, k).unwrap()
                })
                .collect();
            let xs: Vec<Vec<f32>> = ws
                .iter()
                .map(|w| (0..2 * w.k()).map(|_| r.uniform()).collect())
                .collect();
            let got: Vec<Vec<f32>> = with_team(&pool, |team| {
                assert_eq!(team.threads(), threads);
                // Many small products back to back, as a decode step runs them.
                let mut outs = Vec::new();
                for round in 0..50 {
                    for (w, x) in ws.iter().zip(&xs) {
                        let mut out = vec![f32::NAN; 2 * w.n()];
                        team.run(&Product::new(isa, x, 2, w, &mut out, team.threads()).unwrap())
                            .unwrap();
                        if round == 49 {
                            outs.push(out);
                        }
                    }
                }
                outs
            });
            for ((w, x), g) in ws.iter().zip(&xs).zip(&got) {
                let mut want = vec![0f32; 2 * w.n()];
                linear::linear_with(isa, x, 2, w, &mut want).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(g), bits(&want), "threads={threads} n={}", w.n());
            }
        }
    }
}
