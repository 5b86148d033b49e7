//! How the CPU codec spreads a tensor over threads: contiguous ranges of groups (or chunks),
//! one per thread, whose outputs are joined in order, so the bytes never depend on the thread
//! count.

/// Elements per thread below which compression stays on the calling thread.
const MIN_ELEMENTS_PER_THREAD: usize = 1 << 17;

pub(crate) fn thread_count(requested: usize, n: usize) -> usize {
    let by_size = (n / MIN_ELEMENTS_PER_THREAD).max(1);
    let want = if requested == 0 {
        std::thread::available_parallelism().map_or(1, |p| p.get())
    } else {
        requested
    };
    want.min(by_size).max(1)
}

/// Splits `groups` into `parts` contiguous ranges of nearly equal size.
pub(crate) fn split_groups(groups: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let per = groups.div_ceil(parts.max(1)).max(1);
    (0..groups)
        .step_by(per)
        .map(|s| s..(s + per).min(groups))
        .collect()
}

/// Runs `f` on `threads` contiguous ranges of `0..units` (groups, chunks), a scoped thread
/// each when there are several, and returns the results in range order, so that what is built
/// from them never depends on the thread count.
pub(crate) fn map_ranges<R: Send>(
    units: usize,
    threads: usize,
    f: impl Fn(std::ops::Range<usize>) -> R + Sync,
) -> Vec<R> {
    if threads <= 1 {
        return vec![f(0..units)];
    }
    let f = &f;
    crossbeam_utils::thread::scope(|s| {
        let handles: Vec<_> = split_groups(units, threads)
            .into_iter()
            .map(|r| s.spawn(move |_| f(r)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
    .unwrap_or_else(|p| std::panic::resume_unwind(p))
}
