//! Zero-copy exchange for ranks as threads: during a collective each rank exposes its own input and output
//! buffers to its peers, which read (and write) them in place instead of going through staging copies.
//!
//! **Why it is sound.** A rank's buffers are only reachable through its [`Exposure`] slot, a read-write lock:
//! the owner fills the slot under the write lock when its call starts and empties it under the write lock before
//! its call returns, so the empty-ing waits for every peer still holding the slot's read lock; a peer holds that
//! read lock for as long as it touches the buffers (a bounded copy or reduction, never a wait; it never blocks on
//! a slot either, see [`View::lock`]), and checks that
//! the slot is filled, with the length and alignment it expects, before it forms a slice. So no peer touches a
//! buffer after its owner's call returned, whatever happens to the steps in between (a timeout, a peer that
//! left). Within a call, the steps (each rank's descriptor checked against the others') order the accesses, and
//! each algorithm below touches every byte from one rank at a time (see [`two_shot`]).

use std::sync::{RwLock, RwLockReadGuard};

use anyccl_core::Result;

use crate::reduce::{internal, reduce_into, Op, Reducible};

/// A rank's buffers of the collective in progress.
#[derive(Clone, Copy)]
struct Bufs {
    input: *const u8,
    output: *mut u8,
    len: usize,
}

/// One rank's exposure slot (see the module documentation).
#[derive(Default)]
pub(crate) struct Exposure(RwLock<Option<Bufs>>);

// SAFETY: the raw pointers in the slot are only dereferenced under the protocol of the module documentation (the
// owner's buffers outlive every access, which happens under the slot's read lock and within the owner's call);
// the slot itself is a lock, so sharing it between threads is what it is for.
unsafe impl Sync for Exposure {}
// SAFETY: as above: moving the slot to another thread moves only the lock and the pointers' values.
unsafe impl Send for Exposure {}

impl Exposure {
    /// The slot, read-locked, or `None` while its owner holds or waits for the write lock: it fills the slot only
    /// before the step that lets its peers in and empties it only on its way out of the call, so a peer meeting
    /// the write lock knows the owner left. Never blocking here is what keeps a rank that holds some slots'
    /// read locks from waiting on an owner that waits on it.
    fn try_read(&self) -> Option<RwLockReadGuard<'_, Option<Bufs>>> {
        match self.0.try_read() {
            Ok(g) => Some(g),
            // A poisoned lock only means a peer's thread panicked while reading; the slot is still a plain value.
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn set(&self, v: Option<Bufs>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = v;
    }
}

/// Exposes a rank's buffers until dropped; dropping waits for every peer's access to end.
pub(crate) struct Exposed<'a> {
    slot: &'a Exposure,
    output: *mut u8,
    input: *const u8,
    len: usize,
}

impl<'a> Exposed<'a> {
    /// Exposes `output` (and `input`, or `output` itself in place) in `slot` for as long as the borrows last.
    pub(crate) fn new(slot: &'a Exposure, input: Option<&'a [u8]>, output: &'a mut [u8]) -> Result<Self> {
        let len = output.len();
        let out = output.as_mut_ptr();
        let inp = match input {
            Some(i) if i.len() == len => i.as_ptr(),
            Some(i) => return Err(internal(format!("an input of {} bytes for an output of {len}", i.len()))),
            None => out.cast_const(),
        };
        slot.set(Some(Bufs { input: inp, output: out, len }));
        Ok(Exposed { slot, output: out, input: inp, len })
    }
}

impl Drop for Exposed<'_> {
    fn drop(&mut self) {
        self.slot.set(None);
    }
}

/// Every rank's exposed buffers, read-locked: the view a rank works on between two steps.
pub(crate) struct View<'a> {
    /// Held for as long as the view lives: the owners cannot withdraw their buffers meanwhile.
    _guards: Vec<RwLockReadGuard<'a, Option<Bufs>>>,
    bufs: Vec<Bufs>,
}

impl<'a> View<'a> {
    /// Locks every rank's slot and checks that each holds buffers of `len` bytes aligned for `T`.
    pub(crate) fn lock<T>(slots: &'a [Exposure], len: usize) -> Result<Self> {
        let mut guards = Vec::with_capacity(slots.len());
        for (q, slot) in slots.iter().enumerate() {
            match slot.try_read() {
                Some(g) => guards.push(g),
                None => {
                    return Err(internal(format!("rank {q} is leaving the collective (its buffers are withdrawn)")))
                }
            }
        }
        let mut bufs = Vec::with_capacity(guards.len());
        let align = std::mem::align_of::<T>();
        for (q, g) in guards.iter().enumerate() {
            match **g {
                Some(b)
                    if b.len == len
                        && (b.input as usize).is_multiple_of(align)
                        && (b.output as usize).is_multiple_of(align) =>
                {
                    bufs.push(b)
                }
                Some(b) => {
                    return Err(internal(format!(
                        "rank {q} exposed {} bytes (alignment {} / {}) where {len} bytes aligned to {align} were due",
                        b.len,
                        b.input as usize % align,
                        b.output as usize % align
                    )))
                }
                None => return Err(internal(format!("rank {q} withdrew its buffers during a collective"))),
            }
        }
        Ok(View { _guards: guards, bufs })
    }
}

/// The out-of-place one-shot all-reduce's work: every rank's whole input reduced in rank order into this rank's
/// output. Inputs are only read (by every rank), and each rank writes only its own output, which nobody else
/// touches; the caller's steps keep the peers' buffers alive and exposed from before the first read to after the
/// last.
pub(crate) fn one_shot<T: Reducible>(view: &View<'_>, me: &Exposed<'_>, op: Op) -> Result<()> {
    let world = view.bufs.len();
    let esz = std::mem::size_of::<T>();
    if std::ptr::eq(me.input, me.output.cast_const()) || !me.len.is_multiple_of(esz) {
        return Err(internal(format!("a direct one-shot in place or of {} bytes", me.len)));
    }
    let elems = me.len / esz;
    let mut ins: Vec<&[T]> = Vec::with_capacity(world);
    for b in &view.bufs {
        // SAFETY: rank `q`'s input of `me.len` bytes (every rank's length was checked by `View::lock`, whose read
        // lock keeps the buffer exposed, so alive, while `view` lives), aligned for `T` (checked there too); inputs
        // are only ever read during the call, and no output overlaps an input (an output is its owner's exclusive
        // borrow, an input a shared one, both alive for the call).
        ins.push(unsafe { std::slice::from_raw_parts(b.input.cast::<T>(), elems) });
    }
    // SAFETY: this rank's own output of `me.len` bytes, aligned for `T`; out of place nobody else reads or writes
    // it during the call, and it overlaps no input (above).
    let out = unsafe { std::slice::from_raw_parts_mut(me.output.cast::<T>(), elems) };
    reduce_into(&ins, out, op, world);
    Ok(())
}

/// The two-shot all-reduce's work on `rank`'s part, `part` (a byte range, a multiple of `T`'s size), done in
/// blocks of `block` bytes: every rank's input block is reduced in rank order into this rank's output, and the
/// result copied into every peer's output at the same place. Every rank's part is disjoint from the others', and
/// only this rank touches any rank's bytes of `part` (in place, it reads them first and writes them after, block
/// by block); the caller's steps before and after keep the peers off this rank's part until every rank exposed its
/// buffers and until every rank finished. `tmp` (at least `block` bytes, aligned for `T`) holds this rank's own
/// input block in place, where its output would alias it.
pub(crate) fn two_shot<T: Reducible>(
    view: &View<'_>,
    me: &Exposed<'_>,
    rank: usize,
    part: std::ops::Range<usize>,
    block: usize,
    tmp: &mut [T],
    op: Op,
) -> Result<()> {
    let world = view.bufs.len();
    let esz = std::mem::size_of::<T>();
    let block = (block / esz).max(1) * esz;
    if part.end > me.len
        || !part.start.is_multiple_of(esz)
        || !part.end.is_multiple_of(esz)
        || std::mem::size_of_val(tmp) < block
    {
        return Err(internal(format!("a two-shot part {part:?} of {} bytes (block {block})", me.len)));
    }
    let in_place = std::ptr::eq(me.input, me.output.cast_const());
    let mut at = part.start;
    while at < part.end {
        let n = block.min(part.end - at);
        let elems = n / esz;
        {
            if in_place {
                // SAFETY: this rank's own buffer of `me.len` bytes, aligned for `T` (checked by `View::lock`),
                // `at + n <= part.end <= me.len`; only this rank touches these bytes (see above), and the shared
                // slice ends here, before the exclusive one below is formed.
                let own = unsafe { std::slice::from_raw_parts(me.input.add(at).cast::<T>(), elems) };
                tmp[..elems].copy_from_slice(own);
            }
            let tmp: &[T] = &tmp[..elems];
            let mut ins: Vec<&[T]> = Vec::with_capacity(world);
            for (q, b) in view.bufs.iter().enumerate() {
                if q == rank && in_place {
                    ins.push(tmp);
                } else {
                    // SAFETY: rank `q`'s input of `len` bytes, aligned for `T` (checked by `View::lock`, whose
                    // read lock keeps it exposed, so alive, while `view` lives); only this rank touches its bytes
                    // of `part`; nobody writes an input out of place, and in place only this rank writes these
                    // bytes, after this slice's last use.
                    ins.push(unsafe { std::slice::from_raw_parts(b.input.add(at).cast::<T>(), elems) });
                }
            }
            // SAFETY: this rank's own output, `n` bytes at `at` within `me.len`, aligned for `T`; out of place it
            // overlaps no input, in place its only other view (this rank's input) was copied into `tmp` above,
            // and no peer touches this rank's part.
            let out = unsafe { std::slice::from_raw_parts_mut(me.output.add(at).cast::<T>(), elems) };
            reduce_into(&ins, out, op, world);
        }
        for (q, b) in view.bufs.iter().enumerate() {
            if q != rank {
                // SAFETY: `n` bytes at `at` of this rank's output (just written) into rank `q`'s output, both
                // exposed and alive under `view`'s read locks; distinct ranks' buffers do not overlap (each is a
                // live exclusive borrow of its owner), and only this rank touches these bytes of any rank.
                unsafe { std::ptr::copy_nonoverlapping(me.output.add(at).cast_const(), b.output.add(at), n) };
            }
        }
        at += n;
    }
    Ok(())
}
