//! Argument parsing shared by the allocator classes: ints, token ids, sequence ids and counts,
//! checked like the fallback's `_check_int`, `_tokens`, ... (same exception types, same order).

use numpy::{PyArray1, PyArrayMethods, PyUntypedArray};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};
use pyo3::{intern, Borrowed};

use super::type_name;
use crate::allocator::MAX_TOKEN_ID;
use crate::block_table::MAX_COUNT;
use crate::error::Error;

pub(super) const MAX_SEQ_ID: u128 = u64::MAX as u128;

/// `obj.__index__()` as an int; TypeError for bool and non-integers (fallback `_check_int`).
pub(super) fn as_index<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyInt>> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() || !(obj.is_instance_of::<PyInt>() || obj.hasattr(intern!(py, "__index__"))?) {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            type_name(obj)
        )));
    }
    if let Ok(i) = obj.cast::<PyInt>() {
        return Ok(i.clone());
    }
    let r = obj.call_method0(intern!(py, "__index__"))?;
    r.cast_into::<PyInt>()
        .map_err(|_| PyTypeError::new_err(format!("{name}: __index__ returned a non-int")))
}

pub(super) fn range_error(name: &str, lo: u128, hi: u128, got: &str) -> PyErr {
    PyValueError::new_err(format!("{name} must be in [{lo}, {hi}], got {got}"))
}

/// Fallback `_check_int`: TypeError unless an int (not bool), ValueError outside [lo, hi].
#[inline]
pub(super) fn check_int(name: &str, obj: &Bound<'_, PyAny>, lo: u128, hi: u128) -> PyResult<u128> {
    match exact_u64(obj) {
        Some(v) if (lo..=hi).contains(&u128::from(v)) => Ok(v.into()),
        _ => check_int_slow(name, obj, lo, hi),
    }
}

/// The value of an exact `int` that fits in u64 (the hot case: token and sequence ids), else None.
#[inline(always)]
pub(super) fn exact_u64(obj: &Bound<'_, PyAny>) -> Option<u64> {
    if !obj.is_exact_instance_of::<PyInt>() {
        return None;
    }
    // SAFETY: `obj` is a live object of exact type `int` and we are attached to the interpreter.
    let v = unsafe { pyo3::ffi::PyLong_AsUnsignedLongLong(obj.as_ptr()) };
    if v == u64::MAX && PyErr::take(obj.py()).is_some() {
        return None; // negative or too large: the slow path words the error
    }
    Some(v)
}

#[cold]
pub(super) fn check_int_slow(name: &str, obj: &Bound<'_, PyAny>, lo: u128, hi: u128) -> PyResult<u128> {
    let i = as_index(name, obj)?;
    match i.extract::<u128>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(range_error(name, lo, hi, &i.str()?.to_string_lossy())),
    }
}

pub(super) fn check_u64(name: &str, obj: &Bound<'_, PyAny>, lo: u64, hi: u64) -> PyResult<u64> {
    check_int(name, obj, lo.into(), hi.into()).map(|v| v as u64)
}

/// A 1-D, contiguous, native int64/int32 `numpy.ndarray` (exact type) copied out, else None.
pub(super) fn int_array(obj: &Bound<'_, PyAny>) -> Option<Vec<i64>> {
    if !obj.is_exact_instance_of::<PyUntypedArray>() {
        return None;
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return a.to_vec().ok();
    }
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        return a.to_vec().ok().map(|v| v.into_iter().map(i64::from).collect());
    }
    None
}

/// Calls `f` on each item of a list, tuple or any iterable, stopping at the first error.
pub(super) fn for_each_item<'py>(
    obj: &Bound<'py, PyAny>,
    mut f: impl FnMut(&Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    if let Ok(l) = obj.cast::<PyList>() {
        return l.iter().try_for_each(|x| f(&x));
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().try_for_each(|x| f(&x));
    }
    for x in obj.try_iter()? {
        f(&x?)?;
    }
    Ok(())
}

/// Fallback `_tokens`: a sequence of token ids in [0, 2**32 - 1] (str/bytes refused).
pub(super) fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err("token_ids must be a sequence of ints"));
    }
    if let Some(v) = int_array(obj) {
        if let Some(&t) = v.iter().find(|&&t| u32::try_from(t).is_err()) {
            return Err(range_error("token id", 0, MAX_TOKEN_ID.into(), &t.to_string()));
        }
        return Ok(v.into_iter().map(|t| t as u32).collect());
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for_each_item(obj, |x| {
        out.push(check_int("token id", x, 0, MAX_TOKEN_ID.into())? as u32);
        Ok(())
    })?;
    Ok(out)
}

/// Fallback `_salt_bytes`: None, str (UTF-8) or bytes.
pub(super) fn salt(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_cow()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(format!(
        "cache_salt must be str, bytes or None, got {}",
        type_name(obj)
    )))
}

/// `parent_hash`: None means 0, else an int in [0, 2**hash_bits - 1].
pub(super) fn parent_hash(obj: Option<&Bound<'_, PyAny>>, mask: u128) -> PyResult<u128> {
    obj.map_or(Ok(0), |p| check_int("parent_hash", p, 0, mask))
}

pub(super) fn unknown_sequence(obj: &Bound<'_, PyAny>) -> PyErr {
    let text = obj
        .str()
        .map_or_else(|_| "?".to_owned(), |s| s.to_string_lossy().into_owned());
    Error::UnknownSequence(text).into()
}

/// A sequence id for lookup: TypeError unless an int; an int outside u64 is unknown.
#[inline]
pub(super) fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Some(v) = exact_u64(obj) {
        return Ok(v);
    }
    seq_id_slow(obj)
}

#[cold]
pub(super) fn seq_id_slow(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    as_index("seq_id", obj)?
        .extract::<u64>()
        .map_err(|_| unknown_sequence(obj))
}

/// Sequence ids read up to the first bad one; `stop` is what the fallback raises there,
/// after every earlier id was found.
pub(super) struct SeqIds {
    pub(super) ids: Vec<u64>,
    pub(super) stop: Option<PyErr>,
}

pub(super) fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<SeqIds> {
    if let Some(v) = int_array(obj) {
        let valid = v.iter().position(|&t| t < 0).unwrap_or(v.len());
        let stop = v.get(valid).map(|t| Error::UnknownSequence(t.to_string()).into());
        let ids = v[..valid].iter().map(|&t| t as u64).collect();
        return Ok(SeqIds { ids, stop });
    }
    if let Ok(a) = obj.cast::<PyArray1<u64>>() {
        if let (true, Ok(ids)) = (obj.is_exact_instance_of::<PyUntypedArray>(), a.to_vec()) {
            return Ok(SeqIds { ids, stop: None });
        }
    }
    let mut ids = Vec::with_capacity(obj.len().unwrap_or(0));
    let iterable = obj.cast::<PyList>().is_ok() || obj.cast::<PyTuple>().is_ok();
    if !iterable {
        obj.try_iter()?; // not iterable: TypeError before anything else
    }
    let stop = for_each_item(obj, |x| {
        ids.push(seq_id(x)?);
        Ok(())
    })
    .err();
    Ok(SeqIds { ids, stop })
}

/// `num_new_tokens` of `prepare_batch`: its len() and its values, each error kept for its turn.
pub(super) struct Counts {
    pub(super) len: PyResult<usize>,
    pub(super) values: PyResult<Vec<u64>>,
}

pub(super) fn counts(obj: &Bound<'_, PyAny>) -> Counts {
    let len = obj.len();
    let values = match int_array(obj) {
        Some(v) => match v.iter().find(|&&n| !(0..=MAX_COUNT as i64).contains(&n)) {
            Some(n) => Err(range_error("num_new_tokens", 0, MAX_COUNT.into(), &n.to_string())),
            None => Ok(v.into_iter().map(|n| n as u64).collect()),
        },
        None => {
            let mut out = Vec::with_capacity(*len.as_ref().unwrap_or(&0));
            for_each_item(obj, |x| {
                out.push(check_u64("num_new_tokens", x, 0, MAX_COUNT)?);
                Ok(())
            })
            .map(|()| out)
        }
    };
    Counts { len, values }
}

/// An argument with a default, kept raw and checked later in the fallback's order.
pub(super) enum Arg<'py, D> {
    Given(Bound<'py, PyAny>),
    Default(D),
}

impl<'a, 'py, D> FromPyObject<'a, 'py> for Arg<'py, D> {
    type Error = PyErr;
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Arg::Given(obj.to_owned()))
    }
}

/// A dimension argument in `[min, 2**40]`.
pub(super) fn dim(name: &str, v: i64, min: i64) -> PyResult<usize> {
    if v < min || v > (1 << 40) {
        return Err(PyValueError::new_err(format!(
            "{name} must be in [{min}, 2**40], got {v}"
        )));
    }
    Ok(v as usize)
}
