//! SIMD vs scalar spec on random shapes, split-KV vs unsplit, write/copy round trips.

use half::{bf16, f16};

use super::*;

use crate::runtime::available_isas;
use crate::testing::Rng;

struct Case {
    shape: CacheShape,
    hq: usize,
    k32: Vec<f32>,
    v32: Vec<f32>,
    q: Vec<f32>,
    tables: Vec<i32>,
    max_blocks: usize,
    seq_lens: Vec<i32>,
    qsl: Vec<i32>,
}

fn random_case(r: &mut Rng, d: usize, max_len: usize) -> Case {
    case_with(r, d, max_len, |r, l| match r.below(3) {
        0 => 1,
        1 => l,
        _ => 1 + r.below(l as usize) as i32,
    })
}

/// A random case whose sequence of length `l` has `q_len(r, l)` query rows.
fn case_with(r: &mut Rng, d: usize, max_len: usize, q_len: impl Fn(&mut Rng, i32) -> i32) -> Case {
    let bs = [1, 3, 16, 32, 128][r.below(5)];
    let hkv = 1 + r.below(3);
    let hq = hkv * [1, 2, 3, 4][r.below(4)];
    let nseq = 1 + r.below(4);
    let seq_lens: Vec<i32> = (0..nseq).map(|_| 1 + r.below(max_len) as i32).collect();
    let q_lens: Vec<i32> = seq_lens.iter().map(|&l| q_len(r, l)).collect();
    let max_blocks = seq_lens.iter().map(|&l| (l as usize).div_ceil(bs)).max().unwrap() + r.below(2);
    let num_blocks = max_blocks * nseq / 2 + 2;
    let shape = CacheShape {
        num_blocks,
        num_kv_heads: hkv,
        block_size: bs,
        head_dim: d,
    };
    let n = shape.numel().unwrap();
    let k32 = (0..n).map(|_| r.normal()).collect();
    let v32 = (0..n).map(|_| r.normal()).collect();
    // Random ids, repeats allowed; -1 padding past each sequence's blocks.
    let mut tables = vec![-1; nseq * max_blocks];
    for (i, &l) in seq_lens.iter().enumerate() {
        for j in 0..(l as usize).div_ceil(bs) {
            tables[i * max_blocks + j] = r.below(num_blocks) as i32;
        }
    }
    let mut qsl = vec![0];
    for ql in &q_lens {
        qsl.push(qsl.last().unwrap() + ql);
    }
    let t = *qsl.last().unwrap() as usize;
    let q = (0..t * hq * d).map(|_| r.normal()).collect();
    Case {
        shape,
        hq,
        k32,
        v32,
        q,
        tables,
        max_blocks,
        seq_lens,
        qsl,
    }
}

fn run_case(c: &Case, dt: DType, isa: Isa, threads: usize, params: Params) -> Vec<f32> {
    let kf16: Vec<f16> = c.k32.iter().map(|&x| f16::from_f32(x)).collect();
    let vf16: Vec<f16> = c.v32.iter().map(|&x| f16::from_f32(x)).collect();
    let kb: Vec<bf16> = c.k32.iter().map(|&x| bf16::from_f32(x)).collect();
    let vb: Vec<bf16> = c.v32.iter().map(|&x| bf16::from_f32(x)).collect();
    let (k, v) = match dt {
        DType::F32 => (Kv::F32(&c.k32), Kv::F32(&c.v32)),
        DType::F16 => (Kv::F16(&kf16), Kv::F16(&vf16)),
        DType::Bf16 => (Kv::Bf16(&kb), Kv::Bf16(&vb)),
    };
    let b = Batch {
        positions: &[],
        slot_mapping: &[],
        block_tables: &c.tables,
        max_blocks: c.max_blocks,
        indptr: None,
        seq_lens: &c.seq_lens,
        query_start_loc: &c.qsl,
    };
    let q = Queries {
        q: &c.q,
        num_heads: c.hq,
    };
    let mut out = vec![f32::NAN; c.q.len()];
    paged_attention_with(isa, threads, k, v, c.shape, b, q, params, &mut out).unwrap();
    out
}

fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_finite() && y.is_finite() {
                (x - y).abs()
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max)
}

#[test]
fn simd_matches_scalar_on_random_shapes() {
    let simd: Vec<Isa> = available_isas().into_iter().filter(|&i| i != Isa::Scalar).collect();
    #[cfg(target_arch = "aarch64")]
    assert!(simd.contains(&Isa::Neon), "NEON is baseline on aarch64");
    if simd.is_empty() {
        // Only an x86-64 CPU without AVX2+FMA+F16C gets here: there is nothing to compare, and the
        // test says so (a panic would fail the supported scalar-only CPUs; the scalar path is
        // checked against the numpy float64 reference in tests/kernels).
        eprintln!(
            "simd_matches_scalar_on_random_shapes: NOTHING COMPARED, this CPU runs only {:?}",
            available_isas()
        );
        return;
    }
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    for case in 0..60 {
        let d = [8, 64, 80, 96, 128, 256][case % 6];
        let c = random_case(&mut r, d, 300);
        let window = if r.below(3) == 0 { Some(1 + r.below(40)) } else { None };
        let cap = if r.below(4) == 0 { Some(5.0) } else { None };
        let p = Params {
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: window,
            soft_cap: cap,
        };
        for dt in [DType::F32, DType::F16, DType::Bf16] {
            let want = run_case(&c, dt, Isa::Scalar, 1, p);
            for &isa in &simd {
                let got = run_case(&c, dt, isa, 1 + r.below(3), p);
                let e = max_err(&want, &got);
                assert!(
                    e < 2e-5,
                    "case {case} {isa:?} {dt:?} d={d} shape={:?} window={window:?}: max err {e}",
                    c.shape
                );
            }
        }
    }
}

/// A speculative step's verification: a few rows (2-9) per sequence over long contexts, which
/// the x86 builds run through the decode kernel (rows x group <= 12, or 20 at head_dim 256) or the
/// prefill tiles.
#[test]
fn few_rows_per_sequence_match_scalar() {
    let simd: Vec<Isa> = available_isas().into_iter().filter(|&i| i != Isa::Scalar).collect();
    if simd.is_empty() {
        eprintln!(
            "few_rows_per_sequence_match_scalar: NOTHING COMPARED, this CPU runs only {:?}",
            available_isas()
        );
        return;
    }
    let mut r = Rng(0x5eed_f00d);
    for case in 0..48 {
        let d = [8, 64, 80, 128, 256][case % 5];
        let c = case_with(&mut r, d, 700, |r, l| (2 + r.below(8) as i32).min(l));
        let window = if r.below(3) == 0 { Some(1 + r.below(300)) } else { None };
        let cap = if r.below(4) == 0 { Some(5.0) } else { None };
        let p = Params {
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: window,
            soft_cap: cap,
        };
        for dt in [DType::F32, DType::F16, DType::Bf16] {
            let want = run_case(&c, dt, Isa::Scalar, 1, p);
            for &isa in &simd {
                let got = run_case(&c, dt, isa, 1 + r.below(3), p);
                let e = max_err(&want, &got);
                assert!(
                    e < 2e-5,
                    "case {case} {isa:?} {dt:?} d={d} hq={} rows={:?} window={window:?} cap={cap:?}: max err {e}",
                    c.hq,
                    c.qsl
                );
            }
        }
    }
}

#[test]
fn split_kv_matches_unsplit() {
    let mut r = Rng(7);
    for case in 0..12 {
        let c = random_case(&mut r, 64, 3000);
        let window = if case % 3 == 0 { Some(700) } else { None };
        let p = Params {
            scale: 0.125,
            sliding_window: window,
            soft_cap: None,
        };
        for isa in available_isas() {
            let whole = run_case(&c, DType::F32, isa, 1, p);
            let split = run_case(&c, DType::F32, isa, 64, p);
            let e = max_err(&whole, &split);
            assert!(e < 2e-5, "case {case} {isa:?}: max err {e}");
        }
    }
}

#[test]
fn plan_splits_long_single_sequence() {
    let shape = CacheShape {
        num_blocks: 300,
        num_kv_heads: 1,
        block_size: 16,
        head_dim: 8,
    };
    let tables: Vec<i32> = (0..256).collect();
    let b = Batch {
        positions: &[],
        slot_mapping: &[],
        block_tables: &tables,
        max_blocks: 256,
        indptr: None,
        seq_lens: &[4000],
        query_start_loc: &[0, 1],
    };
    let units = plan::plan(&b, &shape, 1, None, 2);
    assert_eq!(units.len(), 1);
    assert_eq!(units[0].len(), 8);
    assert_eq!(units[0][0].key_lo, 0);
    assert_eq!(units[0].last().unwrap().key_hi, 4000);
    for w in units[0].windows(2) {
        assert_eq!(w[0].key_hi, w[1].key_lo);
        assert_eq!(w[1].key_lo % 16, 0);
    }
}

#[test]
fn write_then_copy_round_trip() {
    let shape = CacheShape {
        num_blocks: 4,
        num_kv_heads: 2,
        block_size: 3,
        head_dim: 8,
    };
    let n = shape.numel().unwrap();
    let (mut k, mut v) = (vec![f16::ZERO; n], vec![f16::ZERO; n]);
    let key: Vec<f32> = (0..2 * 16).map(|x| x as f32).collect();
    let val: Vec<f32> = key.iter().map(|x| -x).collect();
    write_kv(KvMut::F16(&mut k), KvMut::F16(&mut v), shape, &key, &val, &[4, -1]).unwrap();
    // slot 4 = block 1, offset 1; head 1 holds key[8..16].
    let o = shape.offset(1, 1, 1);
    assert_eq!(k[o..o + 8].iter().map(|x| x.to_f32()).collect::<Vec<_>>(), key[8..16]);
    copy_blocks(KvMut::F16(&mut k), KvMut::F16(&mut v), shape, &[1, 3]).unwrap();
    let o3 = shape.offset(3, 1, 1);
    assert_eq!(v[o3..o3 + 8], v[o..o + 8]);
    assert!(write_kv(KvMut::F16(&mut k), KvMut::F16(&mut v), shape, &key, &val, &[12, 0]).is_err());
    assert!(copy_blocks(KvMut::F16(&mut k), KvMut::F16(&mut v), shape, &[0, 4]).is_err());
}

#[test]
fn write_blocks_puts_whole_blocks_in_order() {
    let shape = CacheShape {
        num_blocks: 4,
        num_kv_heads: 2,
        block_size: 3,
        head_dim: 8,
    };
    let (n, bn) = (shape.numel().unwrap(), shape.block_numel());
    let (mut k, mut v) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    let sk: Vec<f32> = (0..2 * bn).map(|x| x as f32).collect();
    let sv: Vec<f32> = sk.iter().map(|x| -x).collect();
    write_blocks(
        KvMut::F32(&mut k),
        KvMut::F32(&mut v),
        shape,
        &[3, 1],
        Kv::F32(&sk),
        Kv::F32(&sv),
    )
    .unwrap();
    assert_eq!(k[3 * bn..4 * bn], sk[..bn]);
    assert_eq!(v[bn..2 * bn], sv[bn..]);
    assert!(k[..bn].iter().chain(&k[2 * bn..3 * bn]).all(|x| x.is_nan()));
    let go = |ids: &[i64], sk: Kv, k: &mut [f32], v: &mut [f32]| {
        write_blocks(KvMut::F32(k), KvMut::F32(v), shape, ids, sk, Kv::F32(&sv))
    };
    assert!(go(&[0, 4], Kv::F32(&sk), &mut k, &mut v).is_err()); // block id out of range
    assert!(go(&[0, -1], Kv::F32(&sk), &mut k, &mut v).is_err());
    assert!(go(&[0], Kv::F32(&sk), &mut k, &mut v).is_err()); // 2 blocks of data for 1 id
    let half = vec![f16::ZERO; 2 * bn];
    assert!(go(&[0, 1], Kv::F16(&half), &mut k, &mut v).is_err()); // dtype
}

#[test]
fn validate_rejects_bad_tables() {
    let shape = CacheShape {
        num_blocks: 2,
        num_kv_heads: 1,
        block_size: 4,
        head_dim: 8,
    };
    let z = vec![0.0f32; shape.numel().unwrap()];
    let q = vec![0.0f32; 8];
    let mut out = vec![0.0f32; 8];
    let p = Params::new(8, None, None, None).unwrap();
    let go = |tables: &[i32], seq: i32, out: &mut [f32]| {
        let b = Batch {
            positions: &[],
            slot_mapping: &[],
            block_tables: tables,
            max_blocks: 2,
            indptr: None,
            seq_lens: &[seq],
            query_start_loc: &[0, 1],
        };
        let q = Queries { q: &q, num_heads: 1 };
        paged_attention(Kv::F32(&z), Kv::F32(&z), shape, b, q, p, out)
    };
    assert!(go(&[0, 1], 8, &mut out).is_ok());
    assert!(go(&[0, -1], 8, &mut out).is_err());
    assert!(go(&[0, 2], 8, &mut out).is_err());
    assert!(go(&[0, 1], 9, &mut out).is_err());
    assert!(go(&[0, -1], 0, &mut out).is_err()); // q_len 1 > seq_len 0
    assert!(go(&[0, -1], 4, &mut out).is_ok()); // padding past the used blocks is fine
}

#[test]
fn one_plan_serves_every_layer_of_its_window() {
    // A step's plan, built once, gives each layer's queries the bits of a per-call paged_attention
    // split for the same thread count, and refuses queries or a window it was not split for.
    let mut r = Rng(23);
    for _ in 0..20 {
        let c = random_case(&mut r, 16, 300);
        let b = Batch {
            positions: &[],
            slot_mapping: &[],
            block_tables: &c.tables,
            max_blocks: c.max_blocks,
            indptr: None,
            seq_lens: &c.seq_lens,
            query_start_loc: &c.qsl,
        };
        let t = *c.qsl.last().unwrap() as usize;
        let window = Some(1 + r.below(40));
        let params = Params::new(16, None, window.map(|w| w as i64), None).unwrap();
        let plan = Plan::new(b, c.shape, t, c.hq, window, 2).unwrap();
        let (k, v) = (Kv::F32(&c.k32), Kv::F32(&c.v32));
        for layer in 0..2 {
            let q: Vec<f32> = c.q.iter().map(|&x| x * (1.0 + layer as f32)).collect();
            let queries = Queries { q: &q, num_heads: c.hq };
            let mut got = vec![f32::NAN; q.len()];
            plan.attend(k, v, queries, params, &mut got).unwrap();
            let mut want = vec![f32::NAN; q.len()];
            paged_attention_with(active_isa(16).unwrap(), 2, k, v, c.shape, b, queries, params, &mut want).unwrap();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        let mut out = vec![0.0; c.q.len()];
        let queries = Queries {
            q: &c.q,
            num_heads: c.hq,
        };
        let other = Params::new(16, None, None, None).unwrap();
        assert!(plan.attend(k, v, queries, other, &mut out).is_err());
        let short = Queries {
            q: &c.q[..c.q.len() - 16 * c.hq],
            num_heads: c.hq,
        };
        assert!(plan
            .attend(k, v, short, params, &mut out[..c.q.len() - 16 * c.hq])
            .is_err());
    }
    // Planning checks the batch: a block id past the cache is refused.
    let shape = CacheShape {
        num_blocks: 2,
        num_kv_heads: 1,
        block_size: 4,
        head_dim: 8,
    };
    let b = Batch {
        positions: &[],
        slot_mapping: &[],
        block_tables: &[0, 2],
        max_blocks: 2,
        indptr: None,
        seq_lens: &[8],
        query_start_loc: &[0, 1],
    };
    assert!(Plan::new(b, shape, 1, 1, None, 2).is_err());
}
