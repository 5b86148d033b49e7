//! The engine's part of a checkpoint (`CfcState.state_dict()["engine"]`): written by
//! `Engine.state`, read back by `Engine.load_state` and checked by `parse_engine_state`, all
//! here, so that its fields are named and checked in one place. A checkpoint may come from
//! anywhere: every field is checked (types, ranges) before anything is loaded, and a bad one is
//! a `ValueError` that names it.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyTuple};

use cfc::engine::{BucketState, EngineState, StepCheckState};

/// The largest block exponent a bucket's state may hold (255 is not an exponent).
const MAX_EXPONENT: u8 = 254;

fn bad(what: String) -> PyErr {
    PyValueError::new_err(format!("not a CfcState checkpoint: {what}"))
}

fn repr(v: &Bound<'_, PyAny>) -> String {
    v.repr().map_or_else(|_| "?".into(), |r| r.to_string())
}

/// `key` of a mapping, or None where it is missing (or None).
fn field<'py>(m: &Bound<'py, PyAny>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let v = m.call_method1("get", (key,))?;
    Ok(if v.is_none() { None } else { Some(v) })
}

fn mapping<'py>(v: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyAny>> {
    if v.is_instance_of::<PyDict>() || v.hasattr("get")? && v.hasattr("keys")? {
        Ok(v.clone())
    } else {
        Err(bad(format!("{what} is {}, not a mapping", repr(v))))
    }
}

fn count(v: Option<Bound<'_, PyAny>>, what: &str) -> PyResult<u64> {
    match v {
        Some(v) if v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>() => v
            .extract::<u64>()
            .map_err(|_| bad(format!("{what} is {}, not an integer >= 0", repr(&v)))),
        Some(v) => Err(bad(format!("{what} is {}, not an integer >= 0", repr(&v)))),
        None => Err(bad(format!("{what} is missing"))),
    }
}

fn number(v: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    if v.is_instance_of::<PyBool>()
        || !(v.is_instance_of::<PyInt>() || v.is_instance_of::<PyFloat>())
    {
        return Err(bad(format!("{what} is {}, not a number", repr(v))));
    }
    v.extract::<f64>()
        .map_err(|_| bad(format!("{what} is {}, not a number", repr(v))))
}

fn sequence<'py>(v: Option<Bound<'py, PyAny>>, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    match v {
        None => Ok(Vec::new()),
        Some(v) if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() => {
            v.try_iter()?.collect()
        }
        Some(v) => Err(bad(format!("{what} is {}, not a list", repr(&v)))),
    }
}

/// A choice that may not be made yet: a bool, or None.
fn flag(v: Option<Bound<'_, PyAny>>, what: &str) -> PyResult<Option<bool>> {
    match v {
        None => Ok(None),
        Some(v) if v.is_instance_of::<PyBool>() => Ok(Some(v.extract::<bool>()?)),
        Some(v) => Err(bad(format!("{what} is {}", repr(&v)))),
    }
}

fn numbers(v: Option<Bound<'_, PyAny>>, what: &str) -> PyResult<Vec<f64>> {
    sequence(v, what)?.iter().map(|x| number(x, what)).collect()
}

fn bucket(b: &Bound<'_, PyAny>) -> PyResult<BucketState> {
    let b = mapping(b, "an engine bucket")?;
    let stats = match field(&b, "stats")? {
        None => None,
        Some(s) => match numbers(Some(s), "a bucket's statistics")?[..] {
            [sum_squares, max_abs] => Some((sum_squares, max_abs)),
            _ => {
                return Err(bad(
                    "a bucket's statistics are not (sum of squares, largest magnitude)".into(),
                ))
            }
        },
    };
    let decision = flag(field(&b, "decision")?, "a bucket's decision")?;
    // (block scales': none in a state saved before them)
    let exponents = match field(&b, "exponents")? {
        None => None,
        Some(x) if x.is_instance_of::<PyBytes>() || x.is_instance_of::<PyByteArray>() => {
            let x: Vec<u8> = x.extract()?;
            if x.iter().any(|&e| e > MAX_EXPONENT) {
                return Err(bad(format!(
                    "a bucket's block exponents are not bytes of 0 to {MAX_EXPONENT}"
                )));
            }
            Some(x)
        }
        Some(x) => {
            return Err(bad(format!(
                "a bucket's block exponents are {}, not bytes",
                repr(&x)
            )))
        }
    };
    Ok(BucketState {
        key: count(field(&b, "key")?, "a bucket key")?,
        fingerprint: count(field(&b, "fingerprint")?, "a bucket fingerprint")?,
        numel: count(field(&b, "numel")?, "a bucket's size")?,
        stats,
        decision,
        trial_plain: numbers(field(&b, "trial_plain")?, "a trial time")?,
        trial_compressed: numbers(field(&b, "trial_compressed")?, "a trial time")?,
        exponents,
    })
}

/// The step check's state (`cfc::engine::step_check`): its trial's origin, its step times of
/// each way (finite, >= 0), its verdict.
fn step_check(s: &Bound<'_, PyAny>) -> PyResult<StepCheckState> {
    let s = mapping(s, "the step check")?;
    let origin = match field(&s, "origin")? {
        None => None,
        o => Some(count(o, "the step check's origin")?),
    };
    let times = sequence(field(&s, "times")?, "the step check's times")?;
    let [plain, chosen] = &times[..] else {
        return Err(bad(
            "the step check's times are not [plain, the trial's ways]".into(),
        ));
    };
    let what = "a step time of the step check";
    let times = [
        numbers(Some(plain.clone()), what)?,
        numbers(Some(chosen.clone()), what)?,
    ];
    if times
        .iter()
        .flatten()
        .any(|t| !(t.is_finite() && *t >= 0.0))
    {
        return Err(bad(
            "a step time of the step check is not a finite number >= 0".into(),
        ));
    }
    let verdict = flag(field(&s, "verdict")?, "the step check's verdict")?;
    Ok(StepCheckState {
        origin,
        times,
        verdict,
    })
}

/// The engine's state from a checkpoint's `engine` field, every field checked.
pub(crate) fn read(e: &Bound<'_, PyAny>) -> PyResult<EngineState> {
    let e = mapping(e, "the engine's state")?;
    let buckets =
        field(&e, "buckets")?.ok_or_else(|| bad("no buckets in the engine's state".into()))?;
    let buckets = sequence(Some(buckets), "the engine's buckets")?
        .iter()
        .map(bucket)
        .collect::<PyResult<Vec<_>>>()?;
    let step = count(field(&e, "step")?, "the engine's step")?;
    let origin = count(field(&e, "origin")?, "the engine's origin")?;
    if origin > step {
        return Err(bad(format!(
            "the engine's origin {origin} is past its step {step}"
        )));
    }
    let levels = match field(&e, "levels")? {
        None => None,
        Some(l) => {
            let l = sequence(Some(l), "the engine's levels")?;
            match l
                .into_iter()
                .map(|x| count(Some(x), "the engine's levels"))
                .collect::<PyResult<Vec<_>>>()?[..]
            {
                [nodes, per_node] => Some((nodes, per_node)),
                ref other => {
                    return Err(bad(format!(
                        "the engine's levels are {other:?}, not (nodes, ranks per node)"
                    )))
                }
            }
        }
    };
    let step_check = match field(&e, "step_check")? {
        None => None,
        Some(s) => Some(step_check(&s)?),
    };
    Ok(EngineState {
        step,
        origin,
        buckets,
        levels,
        step_check,
    })
}

/// The engine's state as a checkpoint holds it.
pub(crate) fn write<'py>(py: Python<'py>, s: &EngineState) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", s.step)?;
    d.set_item("origin", s.origin)?;
    let buckets = s
        .buckets
        .iter()
        .map(|b| {
            let e = PyDict::new(py);
            e.set_item("key", b.key)?;
            e.set_item("fingerprint", b.fingerprint)?;
            e.set_item("numel", b.numel)?;
            e.set_item("stats", b.stats)?;
            e.set_item("decision", b.decision)?;
            e.set_item("trial_plain", b.trial_plain.clone())?;
            e.set_item("trial_compressed", b.trial_compressed.clone())?;
            e.set_item(
                "exponents",
                b.exponents.as_ref().map(|x| PyBytes::new(py, x)),
            )?;
            Ok(e)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("buckets", buckets)?;
    d.set_item("levels", s.levels)?;
    let check = match &s.step_check {
        None => None,
        Some(c) => {
            let e = PyDict::new(py);
            e.set_item("origin", c.origin)?;
            e.set_item("times", [c.times[0].clone(), c.times[1].clone()])?;
            e.set_item("verdict", c.verdict)?;
            Some(e)
        }
    };
    d.set_item("step_check", check)?;
    Ok(d)
}

/// A checkpoint's `engine` field, checked, as `Engine.state` writes it: `ValueError` naming
/// the first field that is not what it writes.
#[pyfunction]
pub(crate) fn parse_engine_state<'py>(
    py: Python<'py>,
    state: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    write(py, &read(state)?)
}
