//! Cache writes: scatter this step's K/V into their slots (`write_kv`), whole-block copies
//! (`copy_blocks`, copy-on-write forks) and whole-block writes from outside the pool
//! (`write_blocks`, blocks loaded from a KV tier). Layout as in `mod.rs`; every index is checked first.

use half::slice::HalfFloatSliceExt;

use super::{CacheShape, Kv, KvMut};
use crate::error::{Error, Result};

fn check_cache_pair(k: &KvMut, v: &KvMut, shape: &CacheShape) -> Result<usize> {
    let numel = shape.numel()?;
    if k.dtype() != v.dtype() {
        return Err(Error::Invalid(format!(
            "k_cache is {} but v_cache is {}",
            k.dtype().name(),
            v.dtype().name()
        )));
    }
    if k.len() != numel || v.len() != numel {
        return Err(Error::Invalid(format!(
            "k_cache/v_cache hold {}/{} elements, expected {numel}",
            k.len(),
            v.len()
        )));
    }
    Ok(numel)
}

/// Scatter `key`/`value` `[T, num_kv_heads, head_dim]` f32 into slots `slots` `[T]` (-1 = skip).
pub fn write_kv<'a>(
    mut k: KvMut<'a>,
    mut v: KvMut<'a>,
    shape: CacheShape,
    key: &[f32],
    value: &[f32],
    slots: &[i64],
) -> Result<()> {
    check_cache_pair(&k, &v, &shape)?;
    let (hkv, bs, d) = (shape.num_kv_heads, shape.block_size, shape.head_dim);
    let tok = hkv * d;
    if key.len() != slots.len() * tok || value.len() != slots.len() * tok {
        return Err(Error::Invalid(format!(
            "key/value must be [{}, {hkv}, {d}] ({} elements), got {} and {}",
            slots.len(),
            slots.len() * tok,
            key.len(),
            value.len()
        )));
    }
    let nslots = shape.num_blocks * bs;
    if let Some((t, &s)) = slots.iter().enumerate().find(|(_, &s)| s < -1 || s >= nslots as i64) {
        return Err(Error::Invalid(format!(
            "slot_mapping[{t}] = {s} is not -1 or a slot in [0, {nslots})"
        )));
    }
    // One head row (head_dim values) at a time; `conv` converts a whole row (half's slice
    // conversion uses F16C when the CPU has it, detected at run time).
    fn scatter<T>(dst: &mut [T], src: &[f32], slots: &[i64], shape: &CacheShape, conv: fn(&mut [T], &[f32])) {
        let (hkv, bs, d) = (shape.num_kv_heads, shape.block_size, shape.head_dim);
        for (t, &s) in slots.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let (blk, off) = (s as usize / bs, s as usize % bs);
            for h in 0..hkv {
                let o = shape.offset(blk, h, off);
                conv(&mut dst[o..o + d], &src[(t * hkv + h) * d..(t * hkv + h + 1) * d]);
            }
        }
    }
    for (cache, src) in [(&mut k, key), (&mut v, value)] {
        match cache {
            KvMut::F32(c) => scatter(c, src, slots, &shape, <[f32]>::copy_from_slice),
            KvMut::F16(c) => scatter(c, src, slots, &shape, HalfFloatSliceExt::convert_from_f32_slice),
            KvMut::Bf16(c) => scatter(c, src, slots, &shape, HalfFloatSliceExt::convert_from_f32_slice),
        }
    }
    Ok(())
}

/// Copy whole blocks, `pairs` = flat `[n, 2]` (src, dst), applied in order.
pub fn copy_blocks<'a>(mut k: KvMut<'a>, mut v: KvMut<'a>, shape: CacheShape, pairs: &[i64]) -> Result<()> {
    check_cache_pair(&k, &v, &shape)?;
    if !pairs.len().is_multiple_of(2) {
        return Err(Error::Invalid("pairs must be [n, 2]".into()));
    }
    let nb = shape.num_blocks as i64;
    if let Some((j, &id)) = pairs.iter().enumerate().find(|(_, &id)| id < 0 || id >= nb) {
        return Err(Error::Invalid(format!(
            "pairs[{}, {}] = {id} is not a block id in [0, {nb})",
            j / 2,
            j % 2
        )));
    }
    let n = shape.block_numel();
    fn copy<T: Copy>(c: &mut [T], pairs: &[i64], n: usize) {
        for p in pairs.chunks_exact(2) {
            let (s, d) = (p[0] as usize, p[1] as usize);
            if s != d {
                c.copy_within(s * n..(s + 1) * n, d * n);
            }
        }
    }
    for cache in [&mut k, &mut v] {
        match cache {
            KvMut::F32(c) => copy(c, pairs, n),
            KvMut::F16(c) => copy(c, pairs, n),
            KvMut::Bf16(c) => copy(c, pairs, n),
        }
    }
    Ok(())
}

/// Write whole blocks from outside the pool: `src_k`/`src_v` `[n, num_kv_heads, block_size, head_dim]`
/// (the caches' element type, bit for bit) into blocks `ids` `[n]`, applied in order.
pub fn write_blocks<'a>(
    mut k: KvMut<'a>,
    mut v: KvMut<'a>,
    shape: CacheShape,
    ids: &[i64],
    src_k: Kv<'_>,
    src_v: Kv<'_>,
) -> Result<()> {
    check_cache_pair(&k, &v, &shape)?;
    if ids.is_empty() && src_k.is_empty() && src_v.is_empty() {
        return Ok(()); // nothing to write (an empty view carries no element type to compare)
    }
    let n = shape.block_numel();
    for (name, src) in [("k_blocks", &src_k), ("v_blocks", &src_v)] {
        if src.dtype() != k.dtype() {
            return Err(Error::Invalid(format!(
                "{name} is {} but the caches are {}",
                src.dtype().name(),
                k.dtype().name()
            )));
        }
        if src.len() != ids.len() * n {
            return Err(Error::Invalid(format!(
                "{name} must hold {} blocks of {n} elements ({} elements), got {}",
                ids.len(),
                ids.len() * n,
                src.len()
            )));
        }
    }
    let nb = shape.num_blocks as i64;
    if let Some((j, &id)) = ids.iter().enumerate().find(|(_, &id)| id < 0 || id >= nb) {
        return Err(Error::Invalid(format!(
            "block_ids[{j}] = {id} is not a block id in [0, {nb})"
        )));
    }
    fn put<T: Copy>(c: &mut [T], src: &[T], ids: &[i64], n: usize) {
        for (j, &id) in ids.iter().enumerate() {
            let d = id as usize;
            c[d * n..(d + 1) * n].copy_from_slice(&src[j * n..(j + 1) * n]);
        }
    }
    for (cache, src) in [(&mut k, src_k), (&mut v, src_v)] {
        match (cache, src) {
            (KvMut::F32(c), Kv::F32(s)) => put(c, s, ids, n),
            (KvMut::F16(c), Kv::F16(s)) => put(c, s, ids, n),
            (KvMut::Bf16(c), Kv::Bf16(s)) => put(c, s, ids, n),
            _ => unreachable!("element types checked above"),
        }
    }
    Ok(())
}
