//! SIMD vs scalar (bit for bit), both vs a float64 sum over the unpacked weights, GGUF decoding.

use super::*;

use crate::testing::Rng;
use half::f16;

fn random_weight(r: &mut Rng, n: usize, k: usize) -> QWeight {
    let w: Vec<f32> = (0..n * k).map(|_| r.uniform() * 0.1).collect();
    QWeight::from_f32(&w, n, k).unwrap()
}

/// y[r, n] in float64 from the weights' values (`dequantize`) and the quantized activations (of as
/// many digits as the weight's products take).
fn reference(x: &[f32], m: usize, w: &QWeight) -> Vec<f64> {
    reference_and_size(x, m, w).0
}

/// `reference`, and beside each output the sum of its terms' magnitudes (what f32 sums round against).
fn reference_and_size(x: &[f32], m: usize, w: &QWeight) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (w.n(), w.k());
    let wv = w.dequantize();
    let a = if w.act_digits() == 1 {
        quantize_one(x, m, k, false)
    } else {
        quantize_acts(x, m, k)
    };
    // The activations' values s·(R·h + l), exact in f64.
    let xq: Vec<f64> = (0..m * k)
        .map(|i| {
            let rb = i / QBLOCK;
            a.s[rb] as f64 * (a.base[rb] as f64 * a.hi[i] as f64 + a.lo[i] as f64)
        })
        .collect();
    let (mut y, mut size) = (vec![0f64; m * n], vec![0f64; m * n]);
    for r in 0..m {
        for c in 0..n {
            y[r * n + c] = (0..k).map(|j| wv[c * k + j] * xq[r * k + j]).sum();
            size[r * n + c] = (0..k).map(|j| (wv[c * k + j] * xq[r * k + j]).abs()).sum();
        }
    }
    (y, size)
}

#[test]
fn simd_equals_scalar_bit_for_bit_and_matches_reference() {
    let mut simd: Vec<Isa> = Vec::new();
    for isa in crate::runtime::available_isas() {
        if variant(isa) != Isa::Scalar && !simd.iter().any(|&s| variant(s) == variant(isa)) {
            simd.push(isa);
        }
    }
    if simd.is_empty() {
        // Not a pass in disguise: the scalar tile is still checked against the f64 reference below.
        eprintln!("linear: this CPU runs no SIMD build; only scalar vs the f64 reference is compared");
    }
    let mut r = Rng(0x1234_5678);
    for case in 0..24 {
        let n = [1, 5, 16, 17, 31, 32, 48, 100][r.below(8)];
        let k = 32 * (1 + r.below(8));
        let m = [1, 2, 3, 4, 5, 7, 9, 33][r.below(8)];
        let w = random_weight(&mut r, n, k);
        let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 3.0).collect();
        let mut ys = vec![f32::NAN; m * n];
        linear_with(Isa::Scalar, &x, m, &w, &mut ys).unwrap();
        let yr = reference(&x, m, &w);
        for (i, (&a, &b)) in ys.iter().zip(&yr).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "case {case} [{m},{n},{k}] elem {i}: {a} vs {b}"
            );
        }
        // Every SIMD build this CPU runs, once each (avx2 and avx512 share one without VNNI).
        for &isa in &simd {
            let mut yv = vec![f32::NAN; m * n];
            linear_with(isa, &x, m, &w, &mut yv).unwrap();
            assert_eq!(
                ys.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                yv.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{isa:?} case {case} [{m},{n},{k}]"
            );
        }
    }
}

#[test]
fn two_digits_track_float_activations_closely() {
    let mut r = Rng(5);
    let (n, k, m) = (24, 128, 3);
    let w = random_weight(&mut r, n, k);
    let (codes, d, mm) = w.unpack();
    // One outlier per row, as massive activations do: one digit would lose the small values.
    let mut x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 0.05).collect();
    for row in 0..m {
        x[row * k + 7] = 40.0;
    }
    let mut y = vec![0f32; m * n];
    linear(&x, m, &w, &mut y).unwrap();
    for row in 0..m {
        for c in 0..n {
            let exact: f64 = (0..k)
                .map(|j| {
                    x[row * k + j] as f64
                        * (d[c * (k / QBLOCK) + j / QBLOCK] as f64 * codes[c * k + j] as f64
                            + mm[c * (k / QBLOCK) + j / QBLOCK] as f64)
                })
                .sum();
            let got = y[row * n + c] as f64;
            assert!(
                (got - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                "[{row},{c}] {got} vs {exact}"
            );
        }
    }
}

#[test]
fn simd_quantization_equals_scalar() {
    let mut r = Rng(11);
    let k = 32 * 9;
    let mut x: Vec<f32> = (0..4 * k).map(|_| r.uniform() * 10.0).collect();
    x[5] = f32::NAN; // block 0: NaN
    x[40] = f32::INFINITY; // block 1: infinite
    x[64..96].fill(0.0); // block 2: zero
    x[100] = 1e-40; // block 3: subnormal next to normal values
    x[130] = 3000.0; // block 4: an outlier
    x[160..192].fill(1e-39); // block 5: all subnormal
    for (i, v) in x[192..224].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 0.5 * 127.0 / 8.0; // block 6: exact .5 ties after scaling
    }
    let a = quantize_acts(&x, 4, k);
    let mut simd = vec![
        ("fast avx512", quantize_fast(Isa::Avx512, &x, 4, k, false)),
        ("fast avx2", quantize_fast(Isa::Avx2, &x, 4, k, false)),
    ];
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.available() {
        let mut b = QActs::zeroed(4, k);
        // SAFETY: AVX2 and FMA detected; x and b are sized for 4 rows of k.
        unsafe { avx2::quantize(&x, &mut b) };
        simd.push(("avx2", b));
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (name, b) in simd {
        assert_eq!(a.hi, b.hi, "{name}");
        assert_eq!(a.lo, b.lo, "{name}");
        assert_eq!(bits(&a.s), bits(&b.s), "{name}");
        assert_eq!(a.base, b.base, "{name}");
        assert_eq!(bits(&a.qs), bits(&b.qs), "{name}");
    }
}

/// The 16-block quantizer's reduction tree puts vector j's reduction where `LANE_BLOCK` says, and
/// the ordered form in lane j.
#[cfg(target_arch = "x86_64")]
#[test]
fn reduce16_lanes_are_where_lane_block_says() {
    use std::arch::x86_64::*;
    if !Isa::Avx512.available() {
        return;
    }
    let mut r = Rng(5);
    let vals: Vec<[f32; 16]> = (0..16)
        .map(|_| std::array::from_fn(|_| r.uniform() * 100.0 - 50.0))
        .collect();
    let run = || {
        // SAFETY: AVX-512 F detected (Isa::Avx512); every load reads 16 floats of a [f32; 16].
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|j| _mm512_loadu_ps(vals[j].as_ptr()));
            let (mut raw, mut ord) = ([0f32; 16], [0f32; 16]);
            _mm512_storeu_ps(raw.as_mut_ptr(), x86::reduce16(v, |a, b| _mm512_max_ps(a, b)));
            _mm512_storeu_ps(ord.as_mut_ptr(), x86::reduce16_ordered(v, |a, b| _mm512_max_ps(a, b)));
            (raw, ord)
        }
    };
    let (raw, ord) = run();
    let max = |j: usize| vals[j].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for lane in 0..16 {
        assert_eq!(raw[lane], max(x86::LANE_BLOCK[lane] as usize), "lane {lane}");
        assert_eq!(ord[lane], max(lane), "lane {lane}");
    }
}

/// A quantizer's edge cases at random, one 32-wide block in twelve each: a NaN, an infinity, all zero,
/// all subnormal, constant (a zero residual), an outlier.
fn edge_blocks(r: &mut Rng, x: &mut [f32]) {
    for blk in x.chunks_exact_mut(QBLOCK) {
        match r.below(12) {
            0 => blk[r.below(32)] = f32::NAN,
            1 => blk[r.below(32)] = f32::NEG_INFINITY,
            2 => blk.fill(0.0),
            3 => blk.fill(1e-39),
            4 => blk.iter_mut().for_each(|v| *v = 1.0),
            5 => blk[r.below(32)] = 1e6,
            _ => {}
        }
    }
}

/// Many rows, special blocks (NaN, infinity, zero, subnormal, a NaN-free block whose residual is
/// zero) scattered over the 16-block groups and the remainder: every SIMD quantizer equals the scalar.
#[test]
fn simd_quantization_equals_scalar_over_block_groups() {
    let mut r = Rng(23);
    let (m, k) = (7, 32 * 18);
    let mut x: Vec<f32> = (0..m * k).map(|_| (r.uniform() - 0.5) * 20.0).collect();
    edge_blocks(&mut r, &mut x);
    let a = quantize_acts(&x, m, k);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for v in [Isa::Avx512, Isa::Avx2] {
        let b = quantize_fast(v, &x, m, k, false);
        assert_eq!(a.hi, b.hi, "{v:?}");
        assert_eq!(a.lo, b.lo, "{v:?}");
        assert_eq!(bits(&a.s), bits(&b.s), "{v:?}");
        assert_eq!(a.base, b.base, "{v:?}");
        assert_eq!(bits(&a.qs), bits(&b.qs), "{v:?}");
    }
}

/// The VNNI tile's activations straight from the quantizer (`quantize_tiled`, whole or in parallel
/// chunks of rows) are `pack_tiled` of the scalar digits, with the scalar scales: rows that fill
/// groups of 8 or not, 16-block groups that cross rows, and a remainder of blocks.
#[test]
fn tiled_quantization_equals_packed_scalar_digits() {
    let mut r = Rng(31);
    for (m, k) in [
        (1, 32 * 18),
        (3, 32 * 9),
        (8, 32 * 18),
        (9, 32 * 7),
        (15, 32 * 48),
        (70, 32 * 18),
        (131, 32 * 3),
    ] {
        let mut x: Vec<f32> = (0..m * k).map(|_| (r.uniform() - 0.5) * 20.0).collect();
        x[r.below(m * k)] = f32::NAN;
        x[r.below(m * k)] = 3000.0;
        let mut want = quantize_acts(&x, m, k);
        want.pack_tiled(m, k);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let chunked = [
            ("one", quantize_tiled(&x, m, k, m, false)),
            ("par", quantize_par(Isa::Avx512, &x, m, k, true, false)),
            ("8-row chunks", quantize_tiled(&x, m, k, 8, false)),
            ("uneven chunks", quantize_tiled(&x, m, k, m.div_ceil(3), false)),
        ];
        for (name, got) in chunked {
            assert_eq!(got.tiled, want.tiled, "{name} m={m} k={k}");
            assert!(got.hi.is_empty() && got.lo.is_empty(), "{name} m={m} k={k}");
            assert_eq!(bits(&got.s), bits(&want.s), "{name} m={m} k={k}");
            assert_eq!(got.base, want.base, "{name} m={m} k={k}");
            assert_eq!(bits(&got.qs), bits(&want.qs), "{name} m={m} k={k}");
        }
        for v in [Isa::Avx512, Isa::Avx2] {
            let rows = quantize_par(v, &x, m, k, false, false);
            assert_eq!((&rows.hi, &rows.lo), (&want.hi, &want.lo), "rows {v:?} m={m} k={k}");
        }
    }
}

/// The fast one-digit quantizers (AVX-512's 16-block and per-block forms, in rows, tiled, in
/// parallel chunks; the AVX2 build's fallback) give `quantize_one`'s bytes and scales bit for bit,
/// over NaN, infinite, zero, subnormal, constant and outlier blocks.
#[test]
fn fast_one_digit_quantization_equals_quantize_one() {
    let mut r = Rng(0x1d16);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (m, k) in [
        (1, 32 * 18),
        (3, 32 * 9),
        (8, 32 * 20),
        (9, 32 * 7),
        (33, 32 * 64),
        (70, 32 * 18),
    ] {
        let mut x: Vec<f32> = (0..m * k).map(|_| (r.uniform() - 0.5) * 20.0).collect();
        edge_blocks(&mut r, &mut x);
        let want = quantize_one(&x, m, k, false);
        let mut want_tiled = quantize_one(&x, m, k, false);
        want_tiled.pack_tiled(m, k);
        let label = |name: &str| format!("{name} m={m} k={k}");
        let same_scales = |got: &QActs, name: &str| {
            assert_eq!(got.digits, 1, "{}", label(name));
            assert_eq!(bits(&got.s), bits(&want.s), "{}", label(name));
            assert_eq!(got.base, want.base, "{}", label(name));
            assert_eq!(bits(&got.qs), bits(&want.qs), "{}", label(name));
        };
        for v in [Isa::Avx512, Isa::Avx2, Isa::Scalar] {
            for (name, got) in [
                ("fast", quantize_fast(v, &x, m, k, true)),
                ("par", quantize_par(v, &x, m, k, false, true)),
            ] {
                assert_eq!((&got.hi, &got.lo), (&want.hi, &want.lo), "{} {v:?}", label(name));
                same_scales(&got, name);
            }
        }
        for (name, got) in [
            ("tiled", quantize_tiled(&x, m, k, m, true)),
            ("tiled par", quantize_par(Isa::Avx512, &x, m, k, true, true)),
            ("tiled 8-row chunks", quantize_tiled(&x, m, k, 8, true)),
            ("tiled uneven chunks", quantize_tiled(&x, m, k, m.div_ceil(3), true)),
        ] {
            assert_eq!(got.tiled, want_tiled.tiled, "{}", label(name));
            assert!(got.hi.is_empty() && got.lo.is_empty(), "{}", label(name));
            same_scales(&got, name);
        }
    }
}

#[test]
fn a_row_does_not_depend_on_its_neighbours() {
    let mut r = Rng(99);
    let (n, k) = (40, 96);
    let w = random_weight(&mut r, n, k);
    let x: Vec<f32> = (0..7 * k).map(|_| r.uniform()).collect();
    let mut all = vec![0f32; 7 * n];
    linear(&x, 7, &w, &mut all).unwrap();
    for row in 0..7 {
        let mut one = vec![0f32; n];
        linear(&x[row * k..][..k], 1, &w, &mut one).unwrap();
        assert_eq!(one, all[row * n..][..n]);
    }
}

#[test]
fn float_weights_round_trip_within_half_a_step() {
    let mut r = Rng(7);
    let (n, k) = (3, 64);
    let w: Vec<f32> = (0..n * k).map(|_| r.uniform()).collect();
    let q = QWeight::from_f32(&w, n, k).unwrap();
    let (codes, d, m) = q.unpack();
    for i in 0..n * k {
        let b = i / QBLOCK;
        let back = d[b] * codes[i] as f32 + m[b];
        assert!((back - w[i]).abs() <= 0.5 * d[b] + 1e-6, "{i}: {back} vs {}", w[i]);
    }
    let again = QWeight::from_parts(n, k, &codes, &d, &m).unwrap();
    assert_eq!(again.unpack(), (codes, d, m));
}

#[test]
fn gguf_blocks_decode() {
    // Q4_1: d = 0.5, m = -1, nibbles j -> element j (low) and j + 16 (high).
    let mut blk = Vec::new();
    blk.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
    blk.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
    blk.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let q = QWeight::from_q4_1(&blk, 1, 32).unwrap();
    let (c, d, m) = q.unpack();
    assert_eq!((d[0], m[0]), (0.5, -1.0));
    assert_eq!(&c[..16], &(0..16).collect::<Vec<u8>>()[..]);
    assert_eq!(&c[16..], &(0..16).rev().collect::<Vec<u8>>()[..]);
    // Q8_0: d = 0.25, q = -128..: w = d*q = d*(c - 128).
    let mut blk = Vec::new();
    blk.extend_from_slice(&f16::from_f32(0.25).to_le_bytes());
    blk.extend((0..32).map(|j| (j as i8 - 16) as u8));
    let q = QWeight::from_q8_0(&blk, 1, 32).unwrap();
    let (c, d, m) = q.unpack();
    for (j, &cj) in c.iter().enumerate() {
        assert_eq!(d[0] * cj as f32 + m[0], 0.25 * (j as f32 - 16.0));
    }
}

#[test]
fn bad_shapes_are_errors() {
    assert!(QWeight::from_f32(&[0.0; 31], 1, 31).is_err());
    assert!(QWeight::from_q4_1(&[0; 19], 1, 32).is_err());
    assert!(QWeight::from_f32(&[f32::NAN; 32], 1, 32).is_err());
    let w = QWeight::from_f32(&[0.5; 64], 2, 32).unwrap();
    let mut out = vec![0f32; 2];
    assert!(linear(&[0.0; 31], 1, &w, &mut out).is_err());
    assert!(linear(&[0.0; 32], 1, &w, &mut out[..1]).is_err());
}

#[test]
fn nan_in_a_row_poisons_only_that_row() {
    let w = QWeight::from_f32(&[0.5; 64], 2, 32).unwrap();
    let mut x = vec![1.0f32; 64];
    x[40] = f32::NAN;
    let mut out = vec![0f32; 4];
    linear(&x, 2, &w, &mut out).unwrap();
    assert!(
        out[..2].iter().all(|v| v.is_finite()) && out[2..].iter().all(|v| v.is_nan()),
        "{out:?}"
    );
}

/// Activations whose two digits sit at the edge: per block one element at the block's max (h = ±127,
/// l = 0), the rest at ±(126 + 1/4) of it (h = ±126, l = ±127), signs at random.
fn edge_acts(r: &mut Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x = vec![0f32; m * k];
    for (i, blk) in x.chunks_exact_mut(QBLOCK).enumerate() {
        let scale = [1.0f32, 0.5, 2.0][i % 3];
        for v in blk.iter_mut() {
            let sign = if r.below(2) == 0 { 1.0 } else { -1.0 };
            *v = sign * 126.25 * scale;
        }
        blk[r.below(QBLOCK)] = 127.0 * scale;
    }
    x
}

#[test]
fn saturation_edges_give_the_scalar_bits() {
    let mut r = Rng(0xed6e);
    let a = quantize_acts(&edge_acts(&mut r, 1, 64), 1, 64);
    assert!(
        a.hi.iter().all(|&h| h.unsigned_abs() >= 126)
            && a.lo.iter().filter(|&&l| l.unsigned_abs() == 127).count() >= 60
    );
    for (case, top) in [0u8, 15, 255, 255].into_iter().enumerate() {
        let (n, k, m) = (37, 32 * 5, 5);
        // Codes at 0 and at `top` (and, in the last case, any byte): with 255, a pair of
        // products reaches 2·255·127 = 64770, past i16.
        let codes: Vec<u8> = (0..n * k)
            .map(|_| match (case, r.below(3)) {
                (3, 2) => r.below(256) as u8,
                (_, 0) => 0,
                _ => top,
            })
            .collect();
        let d: Vec<f32> = (0..n * k / QBLOCK).map(|_| 0.01 + r.uniform().abs() * 0.01).collect();
        let mm: Vec<f32> = d.iter().map(|&v| -v * top as f32 / 2.0).collect();
        let w = QWeight::from_parts(n, k, &codes, &d, &mm).unwrap();
        assert_eq!(w.nibbles(), top <= 15, "case {case}");
        let x = edge_acts(&mut r, m, k);
        let mut ys = vec![f32::NAN; m * n];
        linear_with(Isa::Scalar, &x, m, &w, &mut ys).unwrap();
        let yr = reference(&x, m, &w);
        // The offsets m cancel most of each sum: the tolerance is relative to the largest output.
        let big = yr.iter().fold(1f64, |a, v| a.max(v.abs()));
        for (i, (&a, &b)) in ys.iter().zip(&yr).enumerate() {
            assert!((a as f64 - b).abs() <= 1e-5 * big, "case {case} elem {i}: {a} vs {b}");
        }
        for isa in crate::runtime::available_isas() {
            let mut yv = vec![f32::NAN; m * n];
            linear_with(isa, &x, m, &w, &mut yv).unwrap();
            assert_eq!(
                ys.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                yv.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{isa:?} case {case}"
            );
        }
    }
}

#[test]
fn every_5_and_6_bit_code_at_its_top_fills_the_i16_sums_exactly() {
    // The AVX2 tile's whole 5- and 6-bit codes: 4 groups × 2 products of 31·127 = 31496, and 2 groups
    // × 2 products of 63·127 = 32004, in one i16 lane; the second digit's sums likewise (126.25: h =
    // 126, l = 127).
    let (n, k) = (32, 256);
    for (top, bits) in [(31u8, 5), (63, 6)] {
        let w = QWeight::from_parts(
            n,
            k,
            &vec![top; n * k],
            &vec![1.0; n * k / QBLOCK],
            &vec![0.0; n * k / QBLOCK],
        )
        .unwrap();
        assert!(
            (0..w.panels()).all(|p| w.panel_bits(p) == bits && !w.panel_split(p)),
            "{bits} bits"
        );
        for (sign, value) in [(1f32, 1.0f32), (-1.0, 1.0), (1.0, 126.25), (-1.0, 126.25)] {
            for rows in [1, 2, 3] {
                let x = vec![sign * value; rows * k];
                let mut ys = vec![f32::NAN; rows * n];
                linear_with(Isa::Scalar, &x, rows, &w, &mut ys).unwrap();
                let want = sign * value * top as f32 * k as f32;
                assert!(ys.iter().all(|&v| (v - want).abs() <= 1e-5 * want.abs()), "{ys:?}");
                for isa in crate::runtime::available_isas() {
                    let mut y = vec![f32::NAN; rows * n];
                    linear_with(isa, &x, rows, &w, &mut y).unwrap();
                    assert_eq!(y, ys, "{isa:?} {bits} bits, x {}, {rows} rows", sign * value);
                }
            }
        }
    }
}

#[test]
fn every_code_15_and_digit_127_fills_the_i16_sums_exactly() {
    // The nibble mode's worst case: 8 groups × 2 products of 15·127 in one i16 lane = 30480.
    let (n, k) = (16, 64);
    let w = QWeight::from_parts(n, k, &vec![15; n * k], &vec![1.0; n * 2], &vec![0.0; n * 2]).unwrap();
    assert!(w.nibbles());
    for sign in [1i8, -1] {
        let x = vec![sign as f32; 2 * k];
        let a = quantize_acts(&x, 2, k);
        assert!(a.hi.iter().all(|&h| h == 127 * sign));
        let mut ys = vec![f32::NAN; 2 * n];
        linear_with(Isa::Scalar, &x, 2, &w, &mut ys).unwrap();
        assert!(
            ys.iter().all(|&v| (v - sign as f32 * 15.0 * k as f32).abs() < 1e-3),
            "{ys:?}"
        );
        for isa in crate::runtime::available_isas() {
            let mut y = vec![f32::NAN; 2 * n];
            linear_with(isa, &x, 2, &w, &mut y).unwrap();
            assert_eq!(y, ys, "{isa:?}");
        }
    }
}

#[test]
fn four_bit_layout_equals_the_eight_bit_one_bit_for_bit() {
    let mut r = Rng(0x4b17);
    for case in 0..12 {
        let n = [1, 15, 16, 17, 40, 64][r.below(6)];
        let k = 32 * (1 + r.below(6));
        let m = [1, 2, 3, 8, 33][r.below(5)];
        let nb = k / QBLOCK;
        let codes: Vec<u8> = (0..n * k).map(|_| r.below(16) as u8).collect();
        let d: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.01).collect();
        let mm: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.05).collect();
        let w4 = QWeight::from_parts(n, k, &codes, &d, &mm).unwrap();
        let w8 = QWeight::pack_layout(n, k, &codes, &d, &mm, &vec![8; n.div_ceil(PANEL)]);
        assert!(w4.nibbles() && !w8.nibbles());
        assert!(w4.nbytes() < w8.nbytes());
        assert_eq!(w4.unpack(), (codes.clone(), d.clone(), mm.clone()));
        let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 2.0).collect();
        for isa in crate::runtime::available_isas() {
            let (mut y4, mut y8) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            linear_with(isa, &x, m, &w4, &mut y4).unwrap();
            linear_with(Isa::Scalar, &x, m, &w8, &mut y8).unwrap();
            assert_eq!(y4, y8, "case {case} isa {isa:?}");
        }
    }
}

/// Codes `[n, k]` whose panel p's largest code is `tops[p % tops.len()] - 1` (every code below it).
fn layout_codes(r: &mut Rng, n: usize, k: usize, tops: &[usize]) -> Vec<u8> {
    let mut codes = vec![0u8; n * k];
    for p in 0..n.div_ceil(PANEL) {
        let top = tops[p % tops.len()];
        let rows = &mut codes[p * PANEL * k..((p + 1) * PANEL).min(n) * k];
        for c in rows.iter_mut() {
            *c = r.below(top) as u8;
        }
        let at = r.below(rows.len());
        rows[at] = (top - 1) as u8;
    }
    codes
}

/// Every layout (panels of codes < 16, < 32, < 64, any), alone and mixed in one weight, gives the
/// products of the same codes in the 8-bit layout bit for bit: every ISA (scalar, avx2, avx512vnni
/// where the CPU runs it), every tile shape (rows 1..=17 and 33, n not a multiple of 16, k = 32 and
/// 256 on), one and two digits, contiguous and strided outputs; `unpack` gives the codes back.
#[test]
fn every_layout_gives_the_eight_bit_products_bit_for_bit() {
    let mut r = Rng(0x5b17);
    let layouts: [&[usize]; 6] = [&[16], &[32], &[64], &[256], &[32, 64, 16, 256], &[64, 64, 32]];
    let mut case = 0;
    for tops in layouts {
        for &(n, k) in &[(1usize, 32usize), (37, 32), (53, 256), (16, 288), (70, 512)] {
            case += 1;
            let nb = k / QBLOCK;
            let codes = layout_codes(&mut r, n, k, tops);
            let d: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.01).collect();
            let mm: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.05).collect();
            let w = QWeight::from_parts(n, k, &codes, &d, &mm).unwrap();
            let panels = n.div_ceil(PANEL);
            let bits: Vec<usize> = (0..panels)
                .map(|p| match tops[p % tops.len()] {
                    16 => 4,
                    32 => 5,
                    64 => 6,
                    _ => 8,
                })
                .collect();
            for (p, &b) in bits.iter().enumerate() {
                assert_eq!(w.panel_bits(p), b, "case {case} panel {p}");
                assert_eq!(
                    w.code_at[p + 1] - w.code_at[p],
                    k * PANEL * b / 8,
                    "case {case} panel {p}"
                );
            }
            assert_eq!(w.unpack(), (codes.clone(), d.clone(), mm.clone()), "case {case}");
            let w8 = QWeight::pack_layout(n, k, &codes, &d, &mm, &vec![8; panels]);
            assert_eq!(
                w.nbytes(),
                w8.nbytes() - bits.iter().map(|b| k * PANEL * (8 - b) / 8).sum::<usize>()
            );
            for digits in [2, 1] {
                w.set_act_digits(digits).unwrap();
                w8.set_act_digits(digits).unwrap();
                for m in (1..=17).chain([33]) {
                    if m % 3 != case % 3 && m > 9 {
                        continue; // rows 1..=9 always; the rest in turn
                    }
                    let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 2.0 - 1.0).collect();
                    let mut want = vec![f32::NAN; m * n];
                    linear_with(Isa::Scalar, &x, m, &w8, &mut want).unwrap();
                    let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    for isa in crate::runtime::available_isas() {
                        let label = format!("case {case} tops {tops:?} [{m}, {n}, {k}] digits {digits} {isa:?}");
                        let mut y = vec![f32::NAN; m * n];
                        linear_with(isa, &x, m, &w, &mut y).unwrap();
                        assert_eq!(bits_of(&y), bits_of(&want), "{label}");
                        // Strided into a wider output, by `Product` jobs.
                        let (at, ld) = (3, n + 7);
                        let mut wide = vec![f32::NAN; m * ld];
                        let p = Product::strided(isa, &x, m, &w, &mut wide[at..], ld, 2).unwrap();
                        for j in 0..p.jobs() {
                            // SAFETY: each job index once, on this thread alone.
                            unsafe { p.run(j) };
                        }
                        drop(p);
                        for row in 0..m {
                            let got = &wide[row * ld + at..][..n];
                            assert_eq!(
                                bits_of(got),
                                bits_of(&want[row * n..][..n]),
                                "{label} strided row {row}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A panel takes the fewest bits that hold its codes, each panel on its own: one code of 16 in a
/// panel of codes < 16 makes it 5-bit, one of 32 6-bit, one of 64 8-bit.
#[test]
fn the_packers_choose_each_panels_layout_by_its_codes() {
    let (n, k) = (16 * 4 + 3, 64);
    let nb = k / QBLOCK;
    let (d, m) = (vec![0.5f32; n * nb], vec![-1f32; n * nb]);
    let mut r = Rng(0x1a7);
    let mut codes: Vec<u8> = (0..n * k).map(|_| r.below(16) as u8).collect();
    // Panel 0 stays 4-bit; panels 1, 2, 3 get one code of 16, 32, 64 (last row, last column);
    // panel 4 (3 rows) one of 63 in its first row.
    for (p, top) in [(1, 16u8), (2, 32), (3, 64)] {
        codes[((p + 1) * PANEL - 1) * k + k - 1] = top;
    }
    codes[4 * PANEL * k + 5] = 63;
    let w = QWeight::from_parts(n, k, &codes, &d, &m).unwrap();
    let got: Vec<usize> = (0..w.panels()).map(|p| w.panel_bits(p)).collect();
    assert_eq!(got, [4, 5, 6, 8, 6]);
    assert_eq!(
        (w.nibble_panels(), w.bits_panels(5), w.bits_panels(6), w.bits_panels(8)),
        (1, 1, 2, 1)
    );
    assert!(!w.nibbles());
    assert_eq!(w.codes.len(), k * PANEL * (4 + 5 + 6 + 8 + 6) / 8);
    assert_eq!(w.unpack().0, codes);
}

/// GGUF rows take their types' layouts: Q5_0, Q5_1, Q5_K 5 bits; Q6_K rows split 6-bit panels
/// (each block's two halves with their own scales: the file's values exactly). A Q6_K row that
/// shares a panel with rows of another type is folded onto one scale a 32-wide block: 6 bits where
/// every such block's halves share a scale (codes `q`, < 64), else 8.
#[test]
fn gguf_rows_take_their_types_layouts() {
    let mut r = Rng(0x6b17);
    for (ty, bits) in [("Q5_0", 5), ("Q5_1", 5), ("Q5_K", 5), ("Q6_K", 6)] {
        let (n, k) = (40, 256);
        let raw = random_gguf_rows(&mut r, ty, n, k);
        let w = QWeight::from_gguf(ty, &raw, n, k).unwrap();
        assert_eq!(w.bits_panels(bits), w.panels(), "{ty}");
        assert_eq!(w.split_panels(), if ty == "Q6_K" { w.panels() } else { 0 }, "{ty}");
        // The values are the file's (Q6_K's products of its fields are exact in f32; the others'
        // sums round once there).
        let mut want = vec![0f32; n * k];
        gguf::dequantize(ty, &raw, n, k, &mut want).unwrap();
        let close = |a: f64, b: f32| a == b as f64 || (ty != "Q6_K" && (a - b as f64).abs() <= (b.abs() as f64) * 6e-8);
        assert!(w.dequantize().iter().zip(&want).all(|(&a, &b)| close(a, b)), "{ty}");
    }
    // Q6_K with each 32-wide block's two 16-wide scales equal (scales at bytes 192..208).
    let shared_q6 = |r: &mut Rng, rows: usize, k: usize| {
        let mut raw = random_gguf_rows(r, "Q6_K", rows, k);
        for blk in raw.chunks_exact_mut(210) {
            for j in 0..8 {
                blk[192 + 2 * j + 1] = blk[192 + 2 * j];
            }
        }
        raw
    };
    let k = 512;
    // 24 Q4_K rows: panel 1 holds 8 of them and 8 Q6_K rows (folded: 6 bits), panels 2, 3 split.
    let (q4, q6) = (random_gguf_rows(&mut r, "Q4_K", 24, k), shared_q6(&mut r, 29, k));
    let w = QWeight::from_gguf_parts(&[("Q4_K", &q4, 24), ("Q6_K", &q6, 29)], k).unwrap();
    let got: Vec<(usize, bool)> = (0..w.panels()).map(|p| (w.panel_bits(p), w.panel_split(p))).collect();
    assert_eq!(got, [(4, false), (6, false), (6, true), (6, true)]);
    same_products_everywhere(&mut r, &w, &[1, 8, 19, 32], "q4_k + q6_k");
    // One folded Q6_K block with different scales in its halves: that panel goes 8-bit.
    let mut q6b = q6.clone();
    q6b[210 * 3 * (k / 256) + 192 + 1] ^= 0x40; // Q6_K row 3 (panel 1 of the fused weight), block 0
    let w = QWeight::from_gguf_parts(&[("Q4_K", &q4, 24), ("Q6_K", &q6b, 29)], k).unwrap();
    let got: Vec<(usize, bool)> = (0..w.panels()).map(|p| (w.panel_bits(p), w.panel_split(p))).collect();
    assert_eq!(got, [(4, false), (8, false), (6, true), (6, true)]);
    same_products_everywhere(&mut r, &w, &[2, 9, 17], "q4_k + q6_k, 8-bit fold");
    // Split panels take 6 bits and 2 bytes of scales a block and column, plus 4 a super-block.
    let w = QWeight::from_gguf("Q6_K", &q6[..210 * 16 * (k / 256)], 16, k).unwrap();
    assert_eq!(w.nbytes(), 16 * k * 6 / 8 + 16 * (k / 32 * 2 + k / 256 * 4));
}

/// Split panels (GGUF Q6_K rows) on every ISA, every tile (8, 4, 2, 1 rows; tiled and row digits;
/// one and two digits), grid and f32 scales: the scalar products within 1e-5 of the float64 sum
/// over the file's values, every ISA's bit for bit; edge codes and scales (q 0 and 63, sub-block
/// scales -128 and 127, digits at ±127) included.
#[test]
fn split_panels_give_the_scalar_bits_and_the_files_values() {
    let mut r = Rng(0x06b6);
    for case in 0..6 {
        let n = [16, 17, 40, 33, 1, 48][case];
        let k = 256 * (1 + case % 3);
        let mut raw = random_gguf_rows(&mut r, "Q6_K", n, k);
        if case % 2 == 1 {
            // Every q at 63 or 0 (ql 0xff / 0x00, qh all ones / zeros), scales at the i8 ends.
            for (i, blk) in raw.chunks_exact_mut(210).enumerate() {
                let v = if i % 2 == 0 { 0xff } else { 0x00 };
                blk[..192].fill(v);
                for (j, sc) in blk[192..208].iter_mut().enumerate() {
                    *sc = if j % 2 == 0 { 0x80 } else { 0x7f };
                }
            }
        }
        let w = QWeight::from_gguf("Q6_K", &raw, n, k).unwrap();
        assert_eq!(
            (w.split_panels(), w.scale_format()),
            (w.panels(), "grid"),
            "case {case}"
        );
        same_products_everywhere(
            &mut r,
            &w,
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 33],
            &format!("case {case}"),
        );
        same_products_as_f32_scales(&mut r, &w, 9, &format!("case {case} f32"));
        // Mixed with a 32-wide type (no grid): f32 scales, the same split panels and values.
        let q8 = random_gguf_rows(&mut r, "Q8_0", 16, k);
        let wm = QWeight::from_gguf_parts(&[("Q6_K", &raw, n), ("Q8_0", &q8, 16)], k).unwrap();
        assert_ne!(wm.scale_format(), "grid");
        assert_eq!(wm.split_panels(), n / PANEL, "case {case}");
        same_products_everywhere(&mut r, &wm, &[1, 8, 11, 21], &format!("case {case} mixed"));
    }
    // Activations at the digits' edges (one outlier a block, ±127 digits).
    let raw = random_gguf_rows(&mut r, "Q6_K", 32, 512);
    let w = QWeight::from_gguf("Q6_K", &raw, 32, 512).unwrap();
    let x = edge_acts(&mut r, 9, 512);
    let mut want = vec![f32::NAN; 9 * 32];
    linear_with(Isa::Scalar, &x, 9, &w, &mut want).unwrap();
    for isa in crate::runtime::available_isas() {
        let mut y = vec![f32::NAN; 9 * 32];
        linear_with(isa, &x, 9, &w, &mut y).unwrap();
        assert_eq!(y, want, "edge acts {isa:?}");
    }
}

/// `rows` random rows of `ty` with finite scales (their f16 fields set to values in [-1, 1)).
fn random_gguf_rows(r: &mut Rng, ty: &str, rows: usize, k: usize) -> Vec<u8> {
    let rb = gguf::row_bytes(ty, k).unwrap();
    let (el, bb) = gguf::block_shape(ty).unwrap();
    let mut b: Vec<u8> = (0..rows * rb).map(|_| r.below(256) as u8).collect();
    let f16s: &[usize] = match ty {
        "F16" | "Q4_0" | "Q5_0" | "Q8_0" => &[0],
        "Q4_1" | "Q5_1" | "Q4_K" | "Q5_K" => &[0, 2],
        "Q6_K" => &[208],
        _ => &[],
    };
    for blk in b.chunks_exact_mut(bb) {
        for &at in f16s {
            blk[at..at + 2].copy_from_slice(&f16::from_f32(r.uniform()).to_le_bytes());
        }
        match ty {
            "F32" => blk.copy_from_slice(&r.uniform().to_le_bytes()),
            "BF16" => blk.copy_from_slice(&((r.uniform().to_bits() >> 16) as u16).to_le_bytes()),
            _ => {}
        }
    }
    assert_eq!(b.len(), rows * k / el * bb);
    b
}

/// The legacy types' f16 route (`gguf::row_blocks_f16`: scales straight from the file's bits,
/// `m = -2^e·d` by exponent arithmetic) gives what `to_blocks` + `from_parts` give, at the edges
/// too: ±0, subnormal `d` (exact or not once scaled), the largest `d` whose `-2^e·d` is still an
/// f16, and `d` past it (then every scale stays f32, as `from_parts` holds them).
#[test]
fn legacy_f16_scales_equal_the_f32_route_at_the_edges() {
    let mut r = Rng(0x0f16);
    let edges: [u16; 12] = [
        0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x3c00, 0xbc00, 0x5bff, 0x57ff, 0x6bff, 0x7bff,
    ];
    for ty in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"] {
        let (_, bb) = gguf::block_shape(ty).unwrap();
        for (case, &edge) in edges.iter().enumerate() {
            let (n, k) = (17, 96);
            let mut raw = random_gguf_rows(&mut r, ty, n, k);
            // One block in five gets the edge d (and for Q4_1/Q5_1 m too).
            for (i, blk) in raw.chunks_exact_mut(bb).enumerate() {
                if i % 5 == case % 5 {
                    blk[0..2].copy_from_slice(&edge.to_le_bytes());
                    if matches!(ty, "Q4_1" | "Q5_1") {
                        blk[2..4].copy_from_slice(&edge.to_le_bytes());
                    }
                }
            }
            let nb = k / QBLOCK;
            let (mut c, mut d, mut m) = (vec![0u8; n * k], vec![0f32; n * nb], vec![0f32; n * nb]);
            gguf::to_blocks(ty, &raw, n, k, &mut c, &mut d, &mut m).unwrap();
            let want = QWeight::from_parts(n, k, &c, &d, &m).unwrap();
            let got = QWeight::from_gguf(ty, &raw, n, k).unwrap();
            assert_eq!(got.scales, want.scales, "{ty} d=0x{edge:04x}");
            assert_eq!(got.unpack(), want.unpack(), "{ty} d=0x{edge:04x}");
            assert_eq!(got.codes, want.codes, "{ty} d=0x{edge:04x}");
            let e = match ty {
                "Q4_0" => 3,
                "Q5_0" => 4,
                "Q8_0" => 7,
                _ => 0,
            };
            let v = -((1u32 << e) as f32) * f16::from_bits(edge).to_f32();
            let f16_exact = e == 0 || f16::from_f32(v).to_f32().to_bits() == v.to_bits();
            assert_eq!(got.half_scales(), f16_exact, "{ty} d=0x{edge:04x}");
        }
    }
    // A non-finite d is an error naming the row and block, on either route.
    let mut raw = random_gguf_rows(&mut r, "Q8_0", 2, 64);
    raw[34..36].copy_from_slice(&0x7c00u16.to_le_bytes());
    let e = QWeight::from_gguf("Q8_0", &raw, 2, 64).unwrap_err();
    assert!(e.to_string().contains("row 0, block 1: scale is not finite"), "{e}");
}

/// The one-pass panel packer of `from_gguf_parts` gives what decoding every row first and then
/// `from_parts` gives: the same codes, scales and layout (nibbles exactly when every code < 16).
/// (Q6_K rows take split panels, which `from_parts` does not make: `split_panels_*` below.)
#[test]
fn gguf_parts_pack_as_decode_then_from_parts() {
    let mut r = Rng(0x57ac);
    let types = [
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "F16", "BF16", "F32",
    ];
    for case in 0..40 {
        let k = 256 * (1 + r.below(3));
        let nparts = 1 + r.below(3);
        let four = r.below(2) == 0; // half the cases: 4-bit types only
        let mut owned = Vec::new();
        for _ in 0..nparts {
            let ty = if four {
                ["Q4_0", "Q4_1", "Q4_K"][r.below(3)]
            } else {
                types[r.below(types.len())]
            };
            let rows = [1, 7, 16, 33][r.below(4)];
            owned.push((ty, random_gguf_rows(&mut r, ty, rows, k), rows));
        }
        let parts: Vec<(&str, &[u8], usize)> = owned.iter().map(|(t, b, n)| (*t, b.as_slice(), *n)).collect();
        let n: usize = parts.iter().map(|p| p.2).sum();
        let nb = k / QBLOCK;
        let (mut c, mut d, mut m) = (vec![0u8; n * k], vec![0f32; n * nb], vec![0f32; n * nb]);
        let mut at = 0;
        for &(ty, raw, rows) in &parts {
            let rr = at..at + rows;
            gguf::to_blocks(
                ty,
                raw,
                rows,
                k,
                &mut c[rr.start * k..rr.end * k],
                &mut d[rr.start * nb..rr.end * nb],
                &mut m[rr.start * nb..rr.end * nb],
            )
            .unwrap();
            at += rows;
        }
        let want = QWeight::from_parts(n, k, &c, &d, &m).unwrap();
        let got = QWeight::from_gguf_parts(&parts, k).unwrap();
        assert_eq!(got.nibbles(), want.nibbles(), "case {case}");
        assert!(got.nibbles() || !four, "case {case}");
        assert_eq!(got.unpack(), want.unpack(), "case {case}");
        assert_eq!(got.codes, want.codes, "case {case}");
        if parts.iter().all(|p| gguf::is_k_quant(p.0)) {
            // K-quants keep integer scales on the f16 grid: the same numbers, fewer bytes.
            assert_eq!(got.scale_format(), "grid", "case {case}");
            assert_eq!(got.scales.len(), want.scales.len(), "case {case}");
            let same = (0..got.scales.len()).all(|i| got.scales.at(i).to_bits() == want.scales.at(i).to_bits());
            assert!(same, "case {case}");
            assert!(got.nbytes() < want.nbytes() || want.half_scales(), "case {case}");
        } else {
            assert_eq!(got.scales, want.scales, "case {case}");
        }
        // Q4_0/Q4_1/Q5_x/Q8_0 blocks' d and m are f16 numbers (or exact multiples of one by a power of two).
        if parts
            .iter()
            .all(|p| matches!(p.0, "Q4_0" | "Q4_1" | "Q5_0" | "Q5_1" | "Q8_0"))
        {
            assert!(got.half_scales(), "case {case}");
        }
    }
    // Q8_0 rows whose codes all happen to be < 16 (q = -128..-113) take the 4-bit layout, as from_parts.
    let mut raw = random_gguf_rows(&mut r, "Q8_0", 3, 64);
    for blk in raw.chunks_exact_mut(34) {
        for q in &mut blk[2..] {
            *q = (-128 + (*q % 16) as i8) as u8;
        }
    }
    let w = QWeight::from_gguf("Q8_0", &raw, 3, 64).unwrap();
    assert!(w.nibbles());
    let (c, _, _) = w.unpack();
    assert!(c.iter().all(|&x| x < 16));
    // A non-finite scale is an error naming the part, row and block.
    let good = random_gguf_rows(&mut r, "Q4_1", 2, 64);
    let mut bad = random_gguf_rows(&mut r, "Q4_1", 2, 64);
    bad[20 + 20..20 + 22].copy_from_slice(&f16::INFINITY.to_le_bytes()); // row 1, block 0, d
    let e = QWeight::from_gguf_parts(&[("Q4_1", &good, 2), ("Q4_1", &bad, 2)], 64).unwrap_err();
    assert_eq!(e.to_string(), "part 1: row 1, block 0: scale is not finite");
    // With names, the error names the tensor instead; one name a part.
    let parts = [("Q4_1", good.as_slice(), 2), ("Q4_1", bad.as_slice(), 2)];
    let e = QWeight::from_gguf_named(&parts, Some(&["a", "b"]), 64).unwrap_err();
    assert_eq!(e.to_string(), "tensor 'b': row 1, block 0: scale is not finite");
    let e = QWeight::from_gguf_named(&[("Q4_1", good.as_slice(), 3)], Some(&["a"]), 64).unwrap_err();
    assert!(e.to_string().starts_with("tensor 'a': need 3 rows of "), "{e}");
    let e = QWeight::from_gguf_named(&parts, Some(&["a"]), 64).unwrap_err();
    assert_eq!(e.to_string(), "need one name a part: 2 parts, 1 names");
}

/// Each panel picks its code layout: a fused weight of Q4_K rows then Q6_K rows keeps the 4-bit
/// layout in the panels of Q4_K rows only, split 6-bit panels where every row is Q6_K, and the
/// 8-bit one where a panel holds both; every ISA gives the scalar products bit for bit, by `linear`
/// and by `Product` jobs, and where no panel is split, those of the all-8-bit layout.
#[test]
fn mixed_layout_panels_give_the_eight_bit_products() {
    let mut r = Rng(0x3141);
    for (case, (q4, q6, nibble_panels, split_panels)) in [
        (32, 16, 2, 1),
        (20, 12, 1, 0),
        (16, 40, 1, 3),
        (8, 8, 0, 0),
        (48, 0, 3, 0),
    ]
    .into_iter()
    .enumerate()
    {
        let k = 256 * (1 + case % 2);
        let (a, b) = (
            random_gguf_rows(&mut r, "Q4_K", q4, k),
            random_gguf_rows(&mut r, "Q6_K", q6, k),
        );
        let parts: Vec<(&str, &[u8], usize)> = [("Q4_K", a.as_slice(), q4), ("Q6_K", b.as_slice(), q6)]
            .into_iter()
            .filter(|p| p.2 > 0)
            .collect();
        let w = QWeight::from_gguf_parts(&parts, k).unwrap();
        let n = q4 + q6;
        assert_eq!(w.nibble_panels(), nibble_panels, "case {case}");
        assert_eq!(w.split_panels(), split_panels, "case {case}");
        same_products_everywhere(&mut r, &w, &[1, 3, 9, 33, 48], &format!("case {case}"));
        if split_panels > 0 {
            continue;
        }
        let (c, d, m) = w.unpack();
        let w8 = QWeight::pack_layout(n, k, &c, &d, &m, &vec![8; n.div_ceil(PANEL)]);
        assert_eq!(w.codes.len(), w8.codes.len() - nibble_panels * k * PANEL / 2);
        // from_parts picks the same layout from the codes alone.
        let wp = QWeight::from_parts(n, k, &c, &d, &m).unwrap();
        assert_eq!((&wp.codes, &wp.code_at), (&w.codes, &w.code_at), "case {case}");
        same_products_as(&mut r, &w, &w8, &[1, 3, 33], &format!("case {case}"));
    }
}

/// `w`'s scalar products of random rows (each of `row_counts`, two digits then one) are within
/// 1e-5 of the float64 sum over its values (`reference`; relative to its terms' magnitudes), and every ISA's (by `linear` and by
/// one-thread `Product` jobs) are the scalar ones bit for bit.
fn same_products_everywhere(r: &mut Rng, w: &QWeight, row_counts: &[usize], label: &str) {
    let (n, k) = (w.n, w.k);
    for digits in [2, 1] {
        let w = w.clone();
        w.set_act_digits(digits).unwrap();
        for &rows in row_counts {
            let x: Vec<f32> = (0..rows * k).map(|_| r.uniform() * 2.0 - 1.0).collect();
            let mut want = vec![f32::NAN; rows * n];
            linear_with(Isa::Scalar, &x, rows, &w, &mut want).unwrap();
            let (y64, size) = reference_and_size(&x, rows, &w);
            for (i, ((&a, &b), &sz)) in want.iter().zip(&y64).zip(&size).enumerate() {
                assert!(
                    (a as f64 - b).abs() <= 1e-5 * (1.0 + sz),
                    "{label} digits {digits} rows {rows} elem {i}: {a} vs {b} (terms' size {sz})"
                );
            }
            for isa in crate::runtime::available_isas() {
                // With the extension tiles where this CPU runs them (AMX from 16 rows, the AVX2
                // build's AVX-VNNI form), and without.
                for ext in [true, false] {
                    let mut y = vec![f32::NAN; rows * n];
                    if ext {
                        linear_with(isa, &x, rows, &w, &mut y).unwrap();
                    } else {
                        linear_without_ext(isa, &x, rows, &w, &mut y).unwrap();
                    }
                    assert_eq!(y, want, "{label} digits {digits} isa {isa:?} ext {ext} rows {rows}");
                    let mut y = vec![f32::NAN; rows * n];
                    let p = if ext {
                        Product::new(isa, &x, rows, &w, &mut y, 2).unwrap()
                    } else {
                        Product::without_ext(isa, &x, rows, &w, &mut y, 2).unwrap()
                    };
                    for j in (0..p.jobs()).rev() {
                        // SAFETY: each job once, on this thread.
                        unsafe { p.run(j) };
                    }
                    drop(p);
                    assert_eq!(
                        y, want,
                        "{label} digits {digits} isa {isa:?} ext {ext} rows {rows} product"
                    );
                }
            }
        }
    }
}

/// `w`'s products of random rows (by `linear` and by one-thread `Product` jobs) on every ISA are
/// the scalar products of `w8` (the same numbers in the 8-bit layout) bit for bit.
fn same_products_as(r: &mut Rng, w: &QWeight, w8: &QWeight, row_counts: &[usize], label: &str) {
    let (n, k) = (w.n, w.k);
    for &rows in row_counts {
        let x: Vec<f32> = (0..rows * k).map(|_| r.uniform() * 2.0 - 1.0).collect();
        let mut want = vec![f32::NAN; rows * n];
        linear_with(Isa::Scalar, &x, rows, w8, &mut want).unwrap();
        for isa in crate::runtime::available_isas() {
            let mut y = vec![f32::NAN; rows * n];
            linear_with(isa, &x, rows, w, &mut y).unwrap();
            assert_eq!(y, want, "{label} isa {isa:?} rows {rows}");
            let mut y = vec![f32::NAN; rows * n];
            let p = Product::new(isa, &x, rows, w, &mut y, 1).unwrap();
            for j in 0..p.jobs() {
                // SAFETY: each job once, on this thread.
                unsafe { p.run(j) };
            }
            drop(p);
            assert_eq!(y, want, "{label} isa {isa:?} rows {rows} product");
        }
    }
}

/// `w` with its scales as f32 values: the same unpacked numbers, and `w`'s products of `m` random
/// rows (by `linear` and by one-thread `Product` jobs) on every ISA are its scalar ones bit for bit.
fn same_products_as_f32_scales(r: &mut Rng, w: &QWeight, m: usize, label: &str) -> QWeight {
    let (n, k) = (w.n, w.k);
    let mut w32 = w.clone();
    w32.scales = Scales::F32((0..w.scales.len()).map(|i| w.scales.at(i)).collect());
    assert_eq!(w.unpack(), w32.unpack(), "{label}");
    let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 2.0 - 1.0).collect();
    let mut want = vec![f32::NAN; m * n];
    linear_with(Isa::Scalar, &x, m, &w32, &mut want).unwrap();
    for isa in crate::runtime::available_isas() {
        for ww in [w, &w32] {
            let mut y = vec![f32::NAN; m * n];
            linear_with(isa, &x, m, ww, &mut y).unwrap();
            assert_eq!(y, want, "{label} isa {isa:?} {}", ww.scale_format());
            let mut y = vec![f32::NAN; m * n];
            let p = Product::new(isa, &x, m, ww, &mut y, 1).unwrap();
            for j in 0..p.jobs() {
                // SAFETY: each job once, on this thread.
                unsafe { p.run(j) };
            }
            drop(p);
            assert_eq!(y, want, "{label} isa {isa:?} {} product", ww.scale_format());
        }
    }
    w32
}

/// Symmetric GGUF types (Q4_0, Q5_0, Q8_0: `m = r·d`) hold only their `d` (`Scales::Sym`): the
/// file's bytes a weight, and on every ISA, with one and two activation digits, the products of
/// the same scales held as f32, bit for bit. Parts of two ratios, or an asymmetric type, keep both.
#[test]
fn symmetric_types_hold_d_only_and_give_the_same_products() {
    let mut r = Rng(0x5e3);
    for (ty, ratio) in [("Q4_0", -8.0), ("Q5_0", -16.0), ("Q8_0", -128.0)] {
        for n in [1, 16, 23] {
            let k = 32 * (1 + r.below(6));
            let raw = random_gguf_rows(&mut r, ty, n, k);
            let w = QWeight::from_gguf(ty, &raw, n, k).unwrap();
            assert_eq!(w.scale_format(), "sym", "{ty} n {n}");
            assert!(matches!(w.scales, Scales::Sym { r, .. } if r == ratio), "{ty}");
            // Scales: 2 bytes a block and column (as the file's f16 d), the padded panel included.
            let nb = k / QBLOCK;
            assert_eq!(
                w.nbytes() - w.codes.len(),
                2 * n.div_ceil(PANEL) * PANEL * nb,
                "{ty} n {n}"
            );
            for digits in [1, 2] {
                w.set_act_digits(digits).unwrap();
                let m = [1, 2, 5, 9, 33][r.below(5)];
                same_products_as_f32_scales(&mut r, &w, m, &format!("{ty} n {n} digits {digits}"));
            }
        }
    }
    let (a, b) = (
        random_gguf_rows(&mut r, "Q4_0", 16, 64),
        random_gguf_rows(&mut r, "Q8_0", 16, 64),
    );
    let mixed = QWeight::from_gguf_parts(&[("Q4_0", &a, 16), ("Q8_0", &b, 16)], 64).unwrap();
    assert_eq!(mixed.scale_format(), "f16");
    let q41 = random_gguf_rows(&mut r, "Q4_1", 16, 64);
    assert_eq!(QWeight::from_gguf("Q4_1", &q41, 16, 64).unwrap().scale_format(), "f16");
}

/// Scales that are all f16 values are held as f16 (half their bytes) and give the products of the
/// same values held as f32, bit for bit, on every ISA and in both code layouts; one scale that is
/// not an f16 keeps the whole weight in f32.
#[test]
fn half_scales_give_the_f32_products_bit_for_bit() {
    let mut r = Rng(0xf16);
    for case in 0..16 {
        let n = [1, 15, 16, 17, 40][r.below(5)];
        let k = 32 * (1 + r.below(5));
        let m = [1, 2, 5, 33][r.below(4)];
        let nb = k / QBLOCK;
        let top = if case % 2 == 0 { 16 } else { 256 }; // the 4-bit layout, then the 8-bit one
        let codes: Vec<u8> = (0..n * k).map(|_| r.below(top) as u8).collect();
        let h = |v: f32| f16::from_f32(v).to_f32();
        let d: Vec<f32> = (0..n * nb).map(|_| h(r.uniform() * 0.01)).collect();
        let mm: Vec<f32> = (0..n * nb).map(|_| h(r.uniform() * 0.05 - 0.025)).collect();
        let w = QWeight::from_parts(n, k, &codes, &d, &mm).unwrap();
        assert!(w.half_scales(), "case {case}");
        assert_eq!(w.nibbles(), top == 16);
        let w32 = same_products_as_f32_scales(&mut r, &w, m, &format!("case {case}"));
        assert_eq!(w.nbytes() + 2 * w.scales.len(), w32.nbytes());
        assert_eq!(w.unpack(), (codes.clone(), d.clone(), mm.clone()));
        // One m that no f16 holds: the weight keeps f32 scales.
        let mut m2 = mm.clone();
        m2[r.below(n * nb)] = 1.0 + f32::EPSILON;
        assert!(!QWeight::from_parts(n, k, &codes, &d, &m2).unwrap().half_scales());
    }
}

/// K-quant weights hold integer scales on the f16 super-block grid (`Scales::Grid`): the same
/// products as the same numbers held as f32, bit for bit, on every ISA, in every code layout (Q6_K's
/// split panels too) and for long jobs; 2 bytes a block and column plus 4 per 256.
#[test]
fn grid_scales_give_the_f32_products_bit_for_bit() {
    let mut r = Rng(0x9e1d);
    for case in 0..12 {
        let ty = ["Q4_K", "Q5_K", "Q6_K"][case % 3];
        let n = [1, 15, 16, 17, 40, 70][r.below(6)];
        let k = 256 * (1 + r.below(3));
        let m = [1, 2, 5, 33][r.below(4)];
        let raw = random_gguf_rows(&mut r, ty, n, k);
        let w = QWeight::from_gguf(ty, &raw, n, k).unwrap();
        assert_eq!(w.scale_format(), "grid", "case {case}");
        // Q4_K 4 bits, Q5_K 5, Q6_K 6 (split panels).
        let bits = [4, 5, 6][case % 3];
        let nb = k / QBLOCK;
        let panels = n.div_ceil(PANEL);
        assert_eq!(w.bits_panels(bits), panels, "case {case}");
        let codes = panels * PANEL * k * bits / 8;
        // u8 d and m multipliers (Q6_K: i8), f16 bases per 256
        let per_block = 2;
        assert_eq!(
            w.nbytes(),
            codes + panels * PANEL * (per_block * nb + 4 * nb / 8),
            "case {case}"
        );
        same_products_as_f32_scales(&mut r, &w, m, &format!("case {case} {ty}"));
    }
    // Mixed with a type of 32-wide blocks (a Q8_0 part): f16 or f32 scales, as before.
    let a = random_gguf_rows(&mut r, "Q4_K", 3, 256);
    let b = random_gguf_rows(&mut r, "Q8_0", 2, 256);
    let w = QWeight::from_gguf_parts(&[("Q4_K", &a, 3), ("Q8_0", &b, 2)], 256).unwrap();
    assert_ne!(w.scale_format(), "grid");
}

#[test]
fn product_jobs_in_any_order_equal_linear() {
    let mut r = Rng(0x5eed_0042);
    for isa in crate::runtime::available_isas() {
        for &(n, k, m, threads) in &[(1, 32, 1, 2), (100, 64, 1, 2), (700, 96, 3, 3), (40, 32, 0, 1)] {
            let w = random_weight(&mut r, n, k);
            let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 3.0).collect();
            let mut want = vec![f32::NAN; m * n];
            linear_with(isa, &x, m, &w, &mut want).unwrap();
            let mut got = vec![f32::NAN; m * n];
            let p = Product::new(isa, &x, m, &w, &mut got, threads).unwrap();
            assert!(p.jobs() <= 16 * threads.max(1) + 1 && (m == 0) == (p.jobs() == 0));
            for j in (0..p.jobs()).rev() {
                // SAFETY: each job index once, on this thread alone.
                unsafe { p.run(j) };
            }
            drop(p);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{isa:?} n={n} k={k} m={m}"
            );
        }
    }
    let w = random_weight(&mut r, 8, 32);
    let mut out = vec![0f32; 8];
    assert!(Product::new(Isa::Scalar, &[0.0; 31], 1, &w, &mut out, 2).is_err());
    assert!(Product::new(Isa::Scalar, &[0.0; 32], 1, &w, &mut out[..7], 2).is_err());
}

/// A product into the columns of a wider matrix (rows `ld` apart: a vocabulary chunk of the
/// logits) writes the contiguous product's bits there and leaves every other value alone (they are
/// NaN before and after), on every ISA, through `linear_strided`'s rayon jobs and `Product`'s.
#[test]
fn strided_outputs_equal_contiguous_ones_and_touch_nothing_else() {
    let mut r = Rng(0x5eed_1d00);
    for isa in crate::runtime::available_isas() {
        for &(n, k, m, at, ld) in &[
            (40, 64, 3, 5, 100),
            (17, 32, 9, 0, 17),
            (33, 96, 8, 60, 93),
            (16, 32, 1, 3, 19),
        ] {
            for digits in [1, 2] {
                let w = random_weight(&mut r, n, k);
                w.set_act_digits(digits).unwrap();
                let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 3.0).collect();
                let mut want = vec![f32::NAN; m * n];
                linear_with(isa, &x, m, &w, &mut want).unwrap();
                let check = |wide: &[f32], how: &str| {
                    for (i, v) in wide.iter().enumerate() {
                        let (row, col) = (i / ld, i % ld);
                        let label = format!("{how} {isa:?} digits={digits} n={n} m={m} at={at} ld={ld} [{row}, {col}]");
                        if row < m && (at..at + n).contains(&col) {
                            assert_eq!(v.to_bits(), want[row * n + col - at].to_bits(), "{label}");
                        } else {
                            assert!(v.is_nan(), "{label} was written");
                        }
                    }
                };
                let mut wide = vec![f32::NAN; m * ld];
                if isa == crate::runtime::isa().unwrap() {
                    linear_strided(&x, m, &w, &mut wide[at..], ld).unwrap();
                    check(&wide, "linear_strided");
                }
                let mut wide = vec![f32::NAN; m * ld];
                let p = Product::strided(isa, &x, m, &w, &mut wide[at..], ld, 2).unwrap();
                for j in 0..p.jobs() {
                    // SAFETY: each job index once, on this thread alone.
                    unsafe { p.run(j) };
                }
                drop(p);
                check(&wide, "Product::strided");
            }
        }
    }
    let w = random_weight(&mut r, 8, 32);
    let mut out = vec![0f32; 30];
    // A stride shorter than a row, and an output too short for the last row.
    assert!(Product::strided(Isa::Scalar, &[0.0; 64], 2, &w, &mut out, 7, 2).is_err());
    assert!(Product::strided(Isa::Scalar, &[0.0; 64], 2, &w, &mut out[..17], 10, 2).is_err());
    assert!(linear_strided(&[0.0; 64], 2, &w, &mut out[..17], 10).is_err());
    assert!(Product::strided(Isa::Scalar, &[0.0; 64], 2, &w, &mut out[..18], 10, 2).is_ok());
}

/// Jobs of many panels (the decoder's `Product` hands a thread up to ~100) and row counts past a
/// row block (`ROW_BLOCK_BYTES`) give every ISA's tiles the scalar bits, in every code layout.
#[test]
fn long_jobs_and_row_blocks_give_the_scalar_bits() {
    let mut r = Rng(0x7113_0bde);
    for &(n, k, m, threads) in &[
        (2000usize, 64usize, 5usize, 1usize),
        (40, 1536, 70, 2),
        (37, 3072, 17, 1),
        (300, 32, 1601, 1),
        // The AMX tile's row blocks (32 rows at this k), and 5 rows left to the VNNI tile.
        (20, 16384, 85, 1),
    ] {
        let block = (ROW_BLOCK_BYTES / (2 * k)).max(MR);
        assert!(
            n.div_ceil(PANEL) > 16 * JOB_PANELS * threads || m > block,
            "case exercises nothing"
        );
        let nb = k / QBLOCK;
        for (layout, top) in [(4, 16), (5, 32), (6, 64), (8, 256)] {
            let codes: Vec<u8> = (0..n * k).map(|_| r.below(top) as u8).collect();
            let d: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.01).collect();
            let mm: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.05).collect();
            let w = QWeight::from_parts(n, k, &codes, &d, &mm).unwrap();
            assert_eq!(w.bits_panels(layout), w.panels());
            // Two digits for 5- and 6-bit panels, one (the AMX tile's products where this CPU runs
            // it) for 4- and 8-bit ones.
            w.set_act_digits(if layout % 4 == 0 { 1 } else { 2 }).unwrap();
            let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 2.0).collect();
            let mut want = vec![f32::NAN; m * n];
            linear_with(Isa::Scalar, &x, m, &w, &mut want).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for isa in crate::runtime::available_isas() {
                let mut got = vec![f32::NAN; m * n];
                linear_with(isa, &x, m, &w, &mut got).unwrap();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "linear {isa:?} n={n} k={k} m={m} bits={layout}"
                );
                let mut got = vec![f32::NAN; m * n];
                let p = Product::new(isa, &x, m, &w, &mut got, threads).unwrap();
                for j in 0..p.jobs() {
                    // SAFETY: each job index once, on this thread alone.
                    unsafe { p.run(j) };
                }
                drop(p);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "Product {isa:?} n={n} k={k} m={m} bits={layout}"
                );
            }
        }
    }
}

/// The digit ratio at both caps: a block of ±a (h = ±127, no error) takes the i32 budget
/// (⌊8e6 / (32·127)⌋ = 1968) and, with codes at 255, the largest dots the tiles see; a block of one
/// outlier beside exact zeros takes the i16 cap. Every ISA gives the scalar bits and the f64 sum.
#[test]
fn digit_ratio_caps_keep_the_dots_exact() {
    let (n, k, m) = (21, 64, 3);
    let mut x = vec![0f32; m * k];
    for (i, v) in x.iter_mut().enumerate() {
        *v = match (i / QBLOCK) % 2 {
            0 => {
                if i % 3 == 0 {
                    -2.5
                } else {
                    2.5
                }
            }
            _ => {
                if i % QBLOCK == 5 {
                    1000.0
                } else {
                    0.0
                }
            }
        };
    }
    let a = quantize_acts(&x, m, k);
    for (b, &base) in a.base.iter().enumerate() {
        assert_eq!(base, if b % 2 == 0 { 1968 } else { 32767 }, "block {b}");
    }
    let codes = vec![255u8; n * k];
    let d = vec![1e-3f32; n * k / QBLOCK];
    let w = QWeight::from_parts(n, k, &codes, &d, &vec![-0.1f32; n * k / QBLOCK]).unwrap();
    let yr = reference(&x, m, &w);
    for isa in crate::runtime::available_isas() {
        let mut y = vec![f32::NAN; m * n];
        linear_with(isa, &x, m, &w, &mut y).unwrap();
        for (i, (&a, &b)) in y.iter().zip(&yr).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{isa:?} elem {i}: {a} vs {b}"
            );
        }
    }
}

/// One activation digit: the first digit of `quantize_acts`, `l` = 0 and `R` = 1, in either layout,
/// on this thread (19 rows) or in chunks on the pool (131).
#[test]
fn one_digit_is_the_first_of_the_two() {
    for m in [19, 131] {
        one_digit_rows(m);
    }
}

fn one_digit_rows(m: usize) {
    let mut r = Rng(0x0d16 + m as u64);
    let k = 32 * 5;
    let mut x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 4.0).collect();
    x[3] = f32::NAN;
    x[64..96].fill(0.0);
    let (two, one) = (quantize_acts(&x, m, k), quantize_one(&x, m, k, false));
    assert_eq!((one.digits, two.digits), (1, 2));
    assert_eq!(one.hi, two.hi);
    assert!(one.lo.iter().all(|&l| l == 0));
    for (i, &b) in one.base.iter().enumerate() {
        let special = i == 0 || i == 2; // the NaN and the zero block of row 0
        assert_eq!(b, if special { 0 } else { 1 }, "block {i}");
    }
    let mut tiled = quantize_one(&x, m, k, true);
    assert!(tiled.hi.is_empty() && tiled.lo.is_empty());
    let t = std::mem::take(&mut tiled.tiled);
    let mut packed = quantize_one(&x, m, k, false);
    packed.pack_tiled(m, k);
    assert_eq!(t, packed.tiled);
}

/// A one-digit weight: every ISA, by `linear` and by `Product`, gives the scalar bits, and the
/// scalar tile the f64 sum over the one-digit activations, in both code layouts and row layouts.
#[test]
fn one_digit_products_equal_across_isas_and_match_reference() {
    let mut r = Rng(0x1d1_9175);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for case in 0..16 {
        let n = [1, 16, 17, 40, 100][r.below(5)];
        let k = 32 * (1 + r.below(6));
        let m = [1, 2, 3, 5, 8, 9, 16, 33][r.below(8)];
        let nb = k / QBLOCK;
        let top = if case % 2 == 0 { 16 } else { 256 };
        let codes: Vec<u8> = (0..n * k).map(|_| r.below(top) as u8).collect();
        let d: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.01).collect();
        let mm: Vec<f32> = (0..n * nb).map(|_| r.uniform() * 0.05).collect();
        let w = QWeight::from_parts(n, k, &codes, &d, &mm).unwrap();
        w.set_act_digits(1).unwrap();
        let x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 2.0).collect();
        let mut want = vec![f32::NAN; m * n];
        linear_with(Isa::Scalar, &x, m, &w, &mut want).unwrap();
        for (i, (&a, &b)) in want.iter().zip(&reference(&x, m, &w)).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "case {case} elem {i}: {a} vs {b}"
            );
        }
        for isa in crate::runtime::available_isas() {
            let mut got = vec![f32::NAN; m * n];
            linear_with(isa, &x, m, &w, &mut got).unwrap();
            assert_eq!(bits(&got), bits(&want), "linear {isa:?} case {case} [{m},{n},{k}]");
            let mut got = vec![f32::NAN; m * n];
            let p = Product::new(isa, &x, m, &w, &mut got, 2).unwrap();
            for j in 0..p.jobs() {
                // SAFETY: each job index once, on this thread alone.
                unsafe { p.run(j) };
            }
            drop(p);
            assert_eq!(bits(&got), bits(&want), "Product {isa:?} case {case} [{m},{n},{k}]");
        }
    }
}

/// Where an outlier sets a block's scale, one digit loses the small values that two keep: the
/// error the digit choice (per matrix, by measured KL divergence) weighs.
#[test]
fn one_digit_loses_what_two_keep_beside_an_outlier() {
    let mut r = Rng(5);
    let (n, k, m) = (24, 128, 3);
    let w = random_weight(&mut r, n, k);
    let mut x: Vec<f32> = (0..m * k).map(|_| r.uniform() * 0.05).collect();
    for row in 0..m {
        x[row * k + 7] = 40.0;
    }
    let err = |digits: usize| {
        w.set_act_digits(digits).unwrap();
        let mut y = vec![0f32; m * n];
        linear(&x, m, &w, &mut y).unwrap();
        let (codes, d, mm) = w.unpack();
        let mut worst = 0f64;
        for row in 0..m {
            for c in 0..n {
                let exact: f64 = (0..k)
                    .map(|j| {
                        let b = c * (k / QBLOCK) + j / QBLOCK;
                        x[row * k + j] as f64 * (d[b] as f64 * codes[c * k + j] as f64 + mm[b] as f64)
                    })
                    .sum();
                worst = worst.max((y[row * n + c] as f64 - exact).abs() / (1.0 + exact.abs()));
            }
        }
        worst
    };
    let (one, two) = (err(1), err(2));
    assert!(two <= 1e-4 && one > 10.0 * two, "one digit {one}, two digits {two}");
}

#[test]
fn act_digits_are_one_or_two() {
    let w = random_weight(&mut Rng(3), 16, 32);
    assert_eq!(w.act_digits(), 2);
    for bad in [0, 3] {
        assert!(w.set_act_digits(bad).is_err());
        assert_eq!(w.act_digits(), 2);
    }
    w.set_act_digits(1).unwrap();
    assert_eq!((w.act_digits(), w.clone().act_digits()), (1, 1));
}
