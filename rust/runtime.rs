//! The kernel runtime (no pyo3): the one `Isa` enum, CPU detection, the ISA setting
//! (`PAGEDKV_ISA`, read once on first use, or `set_isa`) and the rayon pool the kernels run on.
//!
//! | ISA      | runs on                                   | attention              | linear                          | ops      |
//! |----------|-------------------------------------------|------------------------|---------------------------------|----------|
//! | `scalar` | anything                                  | `reference.rs`         | portable tile                   | plain    |
//! | `avx2`   | x86-64 with AVX2 + FMA + F16C             | `x86/` `attend`        | `avx2.rs` tile (`vpdpbusd` where `avx_vnni()`, else `vpmaddubsw`) | AVX2 build |
//! | `avx512` | also AVX-512 F + VL + BW                  | `x86/` `attend_avx512` | VNNI tile when `avx512_vnni()` (AMX one too when `amx_int8()`), else the AVX2 one | AVX-512 build |
//! | `neon`   | aarch64 (NEON is baseline)                | `aarch64.rs` `attend`  | portable tile                   | plain    |
//!
//! Setting: `auto` (the widest ISA detected) or one ISA forced. `PAGEDKV_ISA=auto|scalar|avx2|
//! avx512|neon` chooses it (read here only); unset means auto. An invalid `PAGEDKV_ISA` is an error
//! at first use (importing never fails on it).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};

/// Instruction set a kernel call runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// The AVX2 kernels compiled with AVX-512 F/VL/BW enabled: 32 registers and wider register
    /// blocks; the quantized linear layer uses AVX-512 VNNI when the CPU has it too.
    Avx512,
    /// aarch64 NEON (any head_dim).
    Neon,
}

impl Isa {
    /// Every ISA, narrowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// The name `PAGEDKV_ISA`, `set_isa` and `kernel_info()` use.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Whether this CPU can run it (runtime detection).
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::Avx512 => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512bw")
                }
                Isa::Neon => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            match self {
                Isa::Scalar => true,
                Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
                _ => false,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            self == Isa::Scalar
        }
    }
}

/// AVX-512 F + BW + VNNI (`vpdpbusd`), what the quantized linear layer's fastest tile needs.
pub fn avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX2 build of the quantized linear layer runs its AVX-VNNI form (`vpdpbusd` on ymm,
/// VEX-encoded: Intel's cores without AVX-512 from Alder Lake and Sierra Forest on, and the AVX-512
/// CPUs that also have it): AVX2 usable and CPUID.(EAX=7, ECX=1):EAX bit 4; `PAGEDKV_AVX_VNNI=0`
/// turns it off (the `vpmaddubsw` form then runs, as on CPUs without it).
pub fn avx_vnni() -> bool {
    static AVX_VNNI: OnceLock<bool> = OnceLock::new();
    *AVX_VNNI.get_or_init(|| {
        let off = std::env::var("PAGEDKV_AVX_VNNI").is_ok_and(|v| v.trim() == "0");
        !off && Isa::Avx2.available() && avx_vnni_detect()
    })
}

#[cfg(target_arch = "x86_64")]
fn avx_vnni_detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 7's sub-leaves: EAX of sub-leaf 0 is the highest one.
    __cpuid_count(7, 0).eax >= 1 && __cpuid_count(7, 1).eax & (1 << 4) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn avx_vnni_detect() -> bool {
    false
}

/// Whether the quantized linear layer's AMX tile runs: AVX-512 VNNI (the rest of the product), AMX-TILE
/// and AMX-INT8 in CPUID, the tile state enabled by the OS in XCR0 (bits 17 and 18), and Linux's
/// permission to use it granted to this process (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); `PAGEDKV_AMX=0`
/// turns it off. Some virtual machines report AMX in CPUID without enabling its state: there the
/// XCR0 or permission check fails, and the VNNI tile runs.
pub fn amx_int8() -> bool {
    static AMX: OnceLock<bool> = OnceLock::new();
    *AMX.get_or_init(|| {
        let off = std::env::var("PAGEDKV_AMX").is_ok_and(|v| v.trim() == "0");
        !off && avx512_vnni() && amx_detect()
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8; CPUID.1:ECX bit 27 OSXSAVE.
    let (leaf7, leaf1) = (__cpuid_count(7, 0), __cpuid_count(1, 0));
    if leaf7.edx & (3 << 24) != 3 << 24 || leaf1.ecx & (1 << 27) == 0 {
        return false;
    }
    let (lo, _hi): (u32, u32);
    // SAFETY: OSXSAVE is set (checked above), so `xgetbv` with ECX = 0 is defined; it only reads XCR0.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi, options(nomem, nostack, preserves_flags))
    };
    if lo & (3 << 17) != 3 << 17 {
        return false;
    }
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the process-wide permission (Linux >= 5.16).
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the arch_prctl system call with a request and an integer argument: no memory is
    // passed; the kernel clobbers rcx and r11 and returns in rax.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        )
    };
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx_detect() -> bool {
    false
}

/// Every ISA this CPU can run, scalar first (what tests iterate over).
pub fn available_isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.available()).collect()
}

/// Widest ISA this CPU runs.
pub fn detected_isa() -> Isa {
    Isa::ALL
        .into_iter()
        .rev()
        .find(|i| i.available())
        .unwrap_or(Isa::Scalar)
}

// ---------------------------------------------------------------------------------------------
// The setting: `None` = auto, `Some(isa)` = forced.

/// `set_isa` state: 0 never called (the environment decides), 1 auto, 2 + index in `Isa::ALL`.
const SET_NONE: u8 = 0;
const SET_AUTO: u8 = 1;
static SET: AtomicU8 = AtomicU8::new(SET_NONE);
/// The environment's setting, read once.
static ENV: OnceLock<Result<Option<Isa>>> = OnceLock::new();

/// `"auto"` or an ISA name this CPU runs.
fn parse(name: &str) -> Result<Option<Isa>> {
    if name == "auto" {
        return Ok(None);
    }
    let Some(isa) = Isa::ALL.into_iter().find(|i| i.name() == name) else {
        return Err(Error::Invalid(format!(
            "ISA must be 'auto', 'scalar', 'avx2' or 'avx512' (x86-64) or 'neon' (aarch64), got {name:?}"
        )));
    };
    if !isa.available() {
        let names: Vec<&str> = available_isas().iter().map(|i| i.name()).collect();
        return Err(Error::Invalid(format!(
            "ISA {name:?} is not supported by this CPU (available: auto, {})",
            names.join(", ")
        )));
    }
    Ok(Some(isa))
}

fn env_setting() -> Result<Option<Isa>> {
    let isa = std::env::var("PAGEDKV_ISA")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if isa.is_empty() {
        return Ok(None);
    }
    parse(&isa).map_err(|e| Error::Invalid(format!("PAGEDKV_ISA: {e}")))
}

/// Force `"scalar"`, `"avx2"`, `"avx512"` or `"neon"`, or go back to `"auto"` (the widest
/// detected); an error naming the available ISAs when this CPU lacks the one asked for.
pub fn set_isa(name: &str) -> Result<()> {
    let state = match parse(name)? {
        None => SET_AUTO,
        Some(isa) => 2 + Isa::ALL.iter().position(|&i| i == isa).unwrap_or(0) as u8,
    };
    SET.store(state, Ordering::Relaxed);
    Ok(())
}

/// The setting: `None` for auto, else the forced ISA (an error when `PAGEDKV_ISA` is invalid).
pub fn isa_setting() -> Result<Option<Isa>> {
    match SET.load(Ordering::Relaxed) {
        SET_NONE => ENV.get_or_init(env_setting).clone(),
        SET_AUTO => Ok(None),
        s => Ok(Isa::ALL.get(usize::from(s - 2)).copied()),
    }
}

/// `"auto"` or the forced ISA's name.
pub fn isa_setting_name() -> Result<&'static str> {
    Ok(isa_setting()?.map_or("auto", Isa::name))
}

/// The ISA the kernels run with: the forced one, else the widest detected.
pub fn isa() -> Result<Isa> {
    Ok(isa_setting()?.unwrap_or_else(detected_isa))
}

// ---------------------------------------------------------------------------------------------
// Thread pool.

static POOL: Mutex<Option<Arc<rayon::ThreadPool>>> = Mutex::new(None);

/// A pool of `n` threads named `pagedkv-<i>`, each flushing subnormal floats to zero
/// (`flush_subnormals`).
pub fn build_pool(n: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("pagedkv-{i}"))
        .start_handler(|_| flush_subnormals())
        .build()
        .map_err(|e| Error::Invalid(format!("cannot start {n} threads: {e}")))
}

/// Subnormal floats read as zero and results that would be subnormal flushed to zero, on the calling
/// thread (x86-64: MXCSR's DAZ and FTZ bits; aarch64: FPCR.FZ; elsewhere nothing). Every kernel runs on
/// the pool's threads, which set this when they start: an operation on a subnormal number takes a
/// microcode assist on x86, about a hundred times an ordinary one, so a product whose block scales
/// multiply to below 2^-126 (tiny activations times a small weight scale) can take a whole step's
/// time again. The values lost are below 2^-126, beside sums of normal numbers; every ISA's kernels
/// run in the same mode, so they still agree bit for bit.
pub fn flush_subnormals() {
    #[cfg(target_arch = "x86_64")]
    {
        let mut csr: u32 = 0;
        // SAFETY: `stmxcsr` stores the 4-byte control register into `csr`, `ldmxcsr` loads it back
        // with bits 15 (FTZ) and 6 (DAZ) set, both valid on every x86-64 CPU (SSE2); only this
        // thread's floating-point mode changes.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr as *mut u32, options(nostack, preserves_flags));
            csr |= 0x8040;
            std::arch::asm!("ldmxcsr [{}]", in(reg) &csr as *const u32, options(nostack, preserves_flags, readonly));
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        let mut fpcr: u64;
        // SAFETY: reads and writes this thread's FPCR, setting bit 24 (FZ, flush-to-zero), which every
        // AArch64 CPU has.
        unsafe {
            std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack, preserves_flags));
            fpcr |= 1 << 24;
            std::arch::asm!("msr fpcr, {}", in(reg) fpcr, options(nomem, nostack, preserves_flags));
        }
    }
}

/// Whether this thread flushes subnormal floats to zero (`flush_subnormals`).
pub fn flushes_subnormals() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let mut csr: u32 = 0;
        // SAFETY: as in `flush_subnormals`: stores this thread's MXCSR into `csr`.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr as *mut u32, options(nostack, preserves_flags)) };
        csr & 0x8040 == 0x8040
    }
    #[cfg(target_arch = "aarch64")]
    {
        let fpcr: u64;
        // SAFETY: as in `flush_subnormals`: reads this thread's FPCR.
        unsafe { std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack, preserves_flags)) };
        fpcr & (1 << 24) != 0
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// The kernel thread pool (default: one thread per available core).
pub fn pool() -> Result<Arc<rayon::ThreadPool>> {
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = g.as_ref() {
        return Ok(p.clone());
    }
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let p = Arc::new(build_pool(n)?);
    *g = Some(p.clone());
    Ok(p)
}

/// Replace the kernel thread pool with one of `n` threads.
pub fn set_num_threads(n: usize) -> Result<()> {
    if n == 0 || n > 1024 {
        return Err(Error::Invalid(format!("num_threads must be in [1, 1024], got {n}")));
    }
    let p = Arc::new(build_pool(n)?);
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
    Ok(())
}

/// Threads of the kernel pool.
pub fn num_threads() -> Result<usize> {
    Ok(pool()?.current_num_threads())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_threads_flush_subnormals_and_the_caller_keeps_its_mode() {
        let flushing = cfg!(any(target_arch = "x86_64", target_arch = "aarch64"));
        let caller = flushes_subnormals();
        let pool = build_pool(2).expect("a pool of two threads");
        assert_eq!(pool.broadcast(|_| flushes_subnormals()), vec![flushing; 2]);
        // a subnormal product on a pool thread is 0 (black_box: computed at run time, not folded)
        let tiny = pool.install(|| std::hint::black_box(1e-38f32) * std::hint::black_box(0.01f32));
        assert_eq!(tiny == 0.0, flushing);
        assert_eq!(flushes_subnormals(), caller);
    }

    #[test]
    fn names_parse_back_and_unknown_ones_are_errors() {
        for isa in available_isas() {
            assert_eq!(parse(isa.name()), Ok(Some(isa)));
        }
        assert_eq!(parse("auto"), Ok(None));
        assert!(parse("avx9000").is_err());
        assert!(detected_isa().available());
    }
}
