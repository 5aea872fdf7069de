//! The validation front-end: every collective passes through these checks before a backend sees it, so a bad call
//! returns a typed [`InvalidArgument`] and touches nothing.

use crate::dtype::{check_reduction, DataType, ReduceOp};
use crate::error::InvalidArgument;
use crate::runtime::{BufferDesc, Location};

/// The send/receive buffers of one call, as descriptors.
///
/// Not `#[non_exhaustive]`: a call is in place or not; there is no third form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InOutDesc {
    /// One buffer is both input and output (the collective's in-place layout).
    InPlace(BufferDesc),
    /// Distinct input and output buffers.
    Separate {
        /// The input.
        send: BufferDesc,
        /// The output.
        recv: BufferDesc,
    },
}

/// Who is calling: the communicator's shape.
///
/// Not `#[non_exhaustive]`: callers of the checks here build one with a literal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallShape {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Where this communicator's buffers must live.
    pub location: Location,
}

/// `count × dtype × factor` in bytes, or [`InvalidArgument::CountOverflow`].
pub fn bytes_for(count: usize, dtype: DataType, factor: usize) -> Result<usize, InvalidArgument> {
    count.checked_mul(dtype.size_bytes()).and_then(|b| b.checked_mul(factor)).ok_or(InvalidArgument::CountOverflow {
        count,
        dtype,
        world: factor,
    })
}

/// Checks one buffer: location, alignment, length.
pub fn check_buffer(
    which: &'static str,
    desc: &BufferDesc,
    need: usize,
    count: usize,
    dtype: DataType,
    shape: &CallShape,
) -> Result<(), InvalidArgument> {
    if desc.location != shape.location {
        return Err(InvalidArgument::WrongDevice { which, found: desc.location, expected: shape.location });
    }
    let align = dtype.size_bytes();
    if !desc.addr.is_multiple_of(align) {
        return Err(InvalidArgument::Misaligned { which, addr: desc.addr, align, dtype });
    }
    if desc.len < need {
        return Err(InvalidArgument::BufferTooSmall { which, have: desc.len, need, count, dtype });
    }
    Ok(())
}

fn check_pair(
    bufs: &InOutDesc,
    send_need: usize,
    recv_need: usize,
    count: usize,
    dtype: DataType,
    shape: &CallShape,
    layout: &'static str,
) -> Result<(), InvalidArgument> {
    match bufs {
        InOutDesc::InPlace(b) => check_buffer("in-place", b, send_need.max(recv_need), count, dtype, shape),
        InOutDesc::Separate { send, recv } => {
            check_buffer("send", send, send_need, count, dtype, shape)?;
            check_buffer("recv", recv, recv_need, count, dtype, shape)?;
            // Only the bytes the call touches matter: a larger allocation may share an allocation's tail.
            let s = BufferDesc { len: send_need, ..*send };
            let r = BufferDesc { len: recv_need, ..*recv };
            if s.overlaps(&r) {
                return Err(InvalidArgument::Overlap {
                    send_addr: send.addr,
                    send_len: send_need,
                    recv_addr: recv.addr,
                    recv_len: recv_need,
                    layout,
                });
            }
            Ok(())
        }
    }
}

fn check_rank(what: &'static str, rank: usize, shape: &CallShape) -> Result<(), InvalidArgument> {
    if rank >= shape.world {
        return Err(InvalidArgument::RankOutOfRange { what, rank, world: shape.world });
    }
    Ok(())
}

/// All-reduce: both buffers hold `count` elements. Returns the message size in bytes.
pub fn all_reduce(
    shape: &CallShape,
    bufs: &InOutDesc,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Result<usize, InvalidArgument> {
    check_reduction(dtype, op)?;
    let bytes = bytes_for(count, dtype, 1)?;
    check_pair(bufs, bytes, bytes, count, dtype, shape, "in-place all-reduce: one buffer is input and output")?;
    Ok(bytes)
}

/// All-gather: the input holds `count` elements, the output `world × count`; in place, this rank's part sits at
/// offset `rank × count` of the output. Returns the output size in bytes.
pub fn all_gather(
    shape: &CallShape,
    bufs: &InOutDesc,
    count: usize,
    dtype: DataType,
) -> Result<usize, InvalidArgument> {
    let part = bytes_for(count, dtype, 1)?;
    let total = bytes_for(count, dtype, shape.world)?;
    check_pair(
        bufs,
        part,
        total,
        count,
        dtype,
        shape,
        "in-place all-gather: this rank's input sits at offset rank × count of the output",
    )?;
    Ok(total)
}

/// Reduce-scatter: the input holds `world × count` elements, the output `count`; in place, the result lands at
/// offset `rank × count` of the input. Returns the input size in bytes.
pub fn reduce_scatter(
    shape: &CallShape,
    bufs: &InOutDesc,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Result<usize, InvalidArgument> {
    check_reduction(dtype, op)?;
    let part = bytes_for(count, dtype, 1)?;
    let total = bytes_for(count, dtype, shape.world)?;
    check_pair(
        bufs,
        total,
        part,
        count,
        dtype,
        shape,
        "in-place reduce-scatter: the result lands at offset rank × count of the input",
    )?;
    Ok(total)
}

/// Broadcast from `root`: both buffers hold `count` elements.
pub fn broadcast(
    shape: &CallShape,
    bufs: &InOutDesc,
    count: usize,
    dtype: DataType,
    root: usize,
) -> Result<usize, InvalidArgument> {
    check_rank("root", root, shape)?;
    let bytes = bytes_for(count, dtype, 1)?;
    check_pair(bufs, bytes, bytes, count, dtype, shape, "in-place broadcast: one buffer is input and output")?;
    Ok(bytes)
}

/// Reduce to `root`: both buffers hold `count` elements (the output is written on the root only).
pub fn reduce(
    shape: &CallShape,
    bufs: &InOutDesc,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
) -> Result<usize, InvalidArgument> {
    check_reduction(dtype, op)?;
    check_rank("root", root, shape)?;
    let bytes = bytes_for(count, dtype, 1)?;
    check_pair(bufs, bytes, bytes, count, dtype, shape, "in-place reduce: one buffer is input and output")?;
    Ok(bytes)
}

/// Send to or receive from `peer`: the buffer holds `count` elements.
pub fn point_to_point(
    shape: &CallShape,
    which: &'static str,
    buf: &BufferDesc,
    count: usize,
    dtype: DataType,
    peer: usize,
) -> Result<usize, InvalidArgument> {
    check_rank("peer", peer, shape)?;
    if peer == shape.rank {
        return Err(InvalidArgument::SelfPeer { rank: peer });
    }
    let bytes = bytes_for(count, dtype, 1)?;
    check_buffer(which, buf, bytes, count, dtype, shape)?;
    Ok(bytes)
}

/// One operation of a grouped point-to-point call, as the checks see it.
///
/// Not `#[non_exhaustive]`: the front-end and tests build one with a literal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pDesc {
    /// Whether the operation receives (else it sends).
    pub recv: bool,
    /// Its buffer.
    pub buf: BufferDesc,
    /// Element count.
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// The other rank.
    pub peer: usize,
}

impl P2pDesc {
    fn kind(&self) -> &'static str {
        if self.recv {
            "recv"
        } else {
            "send"
        }
    }
}

/// A grouped point-to-point call: each operation passes [`point_to_point`] (a failure is
/// [`InvalidArgument::GroupOp`] naming it), and no receive buffer overlaps another receive buffer or a send buffer
/// in the bytes they touch ([`InvalidArgument::GroupOverlap`]); sends may share bytes. Returns each operation's size
/// in bytes.
pub fn p2p_group(shape: &CallShape, ops: &[P2pDesc]) -> Result<Vec<usize>, InvalidArgument> {
    let mut bytes = Vec::with_capacity(ops.len());
    for (index, op) in ops.iter().enumerate() {
        let b = point_to_point(shape, op.kind(), &op.buf, op.count, op.dtype, op.peer)
            .map_err(|e| InvalidArgument::GroupOp { index, error: Box::new(e) })?;
        bytes.push(b);
    }
    // Touched ranges: (start, length, index). Every buffer lives where the communicator works (checked above).
    let touched = |i: usize| (ops[i].buf.addr, bytes[i], i);
    let mut recvs: Vec<(usize, usize, usize)> =
        (0..ops.len()).filter(|i| ops[*i].recv && bytes[*i] > 0).map(touched).collect();
    recvs.sort_unstable();
    let overlap = |a: (usize, usize, usize), b: (usize, usize, usize)| {
        let (x, y) = if a.2 < b.2 { (a, b) } else { (b, a) };
        InvalidArgument::GroupOverlap {
            first: x.2,
            first_kind: ops[x.2].kind(),
            first_addr: x.0,
            first_len: x.1,
            second: y.2,
            second_kind: ops[y.2].kind(),
            second_addr: y.0,
            second_len: y.1,
        }
    };
    // Sorted by start, disjoint receives never reach past their successor's start.
    for w in recvs.windows(2) {
        if w[0].0.saturating_add(w[0].1) > w[1].0 {
            return Err(overlap(w[0], w[1]));
        }
    }
    for s in (0..ops.len()).filter(|i| !ops[*i].recv && bytes[*i] > 0).map(touched) {
        // The first receive that ends after this send starts is the only one that can overlap it first.
        let at = recvs.partition_point(|r| r.0.saturating_add(r.1) <= s.0);
        if let Some(r) = recvs.get(at).filter(|r| r.0 < s.0.saturating_add(s.1)) {
            return Err(overlap(s, *r));
        }
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: CallShape = CallShape { rank: 1, world: 4, location: Location::Device { ordinal: 0 } };

    fn dev(addr: usize, len: usize) -> BufferDesc {
        BufferDesc { addr, len, location: Location::Device { ordinal: 0 } }
    }

    #[test]
    fn accepts_valid_calls() {
        let sep = InOutDesc::Separate { send: dev(0x1000, 64), recv: dev(0x2000, 256) };
        assert_eq!(all_reduce(&SHAPE, &sep, 16, DataType::F32, ReduceOp::Sum), Ok(64));
        assert_eq!(all_gather(&SHAPE, &sep, 16, DataType::F32), Ok(256));
        assert_eq!(all_reduce(&SHAPE, &InOutDesc::InPlace(dev(0x1000, 64)), 0, DataType::F16, ReduceOp::Avg), Ok(0));
    }

    #[test]
    fn each_class_of_bad_input_has_its_error() {
        let sep = |s, r| InOutDesc::Separate { send: s, recv: r };
        let e = all_reduce(&SHAPE, &sep(dev(0x1000, 60), dev(0x2000, 64)), 16, DataType::F32, ReduceOp::Sum);
        assert!(matches!(e, Err(InvalidArgument::BufferTooSmall { which: "send", have: 60, need: 64, .. })));
        let e = all_gather(&SHAPE, &sep(dev(0x1000, 64), dev(0x2000, 64)), 16, DataType::F32);
        assert!(matches!(e, Err(InvalidArgument::BufferTooSmall { which: "recv", need: 256, .. })));
        let e = all_reduce(&SHAPE, &sep(dev(0x1002, 64), dev(0x2000, 64)), 16, DataType::F32, ReduceOp::Sum);
        assert!(matches!(e, Err(InvalidArgument::Misaligned { which: "send", align: 4, .. })));
        let foreign = BufferDesc { addr: 0x2000, len: 64, location: Location::Device { ordinal: 3 } };
        let e = all_reduce(&SHAPE, &sep(dev(0x1000, 64), foreign), 16, DataType::F32, ReduceOp::Sum);
        assert!(matches!(e, Err(InvalidArgument::WrongDevice { which: "recv", .. })));
        let e = all_reduce(&SHAPE, &sep(dev(0x1000, 64), dev(0x2000, 64)), 16, DataType::I32, ReduceOp::Avg);
        assert!(matches!(e, Err(InvalidArgument::UnsupportedReduction { .. })));
        let e = broadcast(&SHAPE, &sep(dev(0x1000, 64), dev(0x2000, 64)), 16, DataType::F32, 4);
        assert!(matches!(e, Err(InvalidArgument::RankOutOfRange { what: "root", rank: 4, world: 4 })));
        let e = point_to_point(&SHAPE, "send", &dev(0x1000, 64), 16, DataType::F32, 1);
        assert!(matches!(e, Err(InvalidArgument::SelfPeer { rank: 1 })));
        let e = all_reduce(&SHAPE, &sep(dev(0x1000, 64), dev(0x1020, 64)), 16, DataType::F32, ReduceOp::Sum);
        assert!(matches!(e, Err(InvalidArgument::Overlap { .. })));
        let e =
            all_reduce(&SHAPE, &sep(dev(0x1000, 64), dev(0x2000, 64)), usize::MAX / 2, DataType::F32, ReduceOp::Sum);
        assert!(matches!(e, Err(InvalidArgument::CountOverflow { .. })));
    }

    #[test]
    fn in_place_errors_name_the_buffer_once() {
        let e = all_reduce(&SHAPE, &InOutDesc::InPlace(dev(0x1000, 60)), 16, DataType::F32, ReduceOp::Sum)
            .expect_err("60 bytes hold 15 f32");
        assert_eq!(e.to_string(), "in-place buffer holds 60 bytes, but 16 × f32 needs 64");
        let e = all_reduce(&SHAPE, &InOutDesc::InPlace(dev(0x1002, 64)), 16, DataType::F32, ReduceOp::Sum)
            .expect_err("misaligned");
        assert_eq!(e.to_string(), "in-place buffer at 0x1002 is not aligned to 4 bytes, as f32 requires");
        let e = point_to_point(&SHAPE, "recv", &dev(0x1000, 60), 16, DataType::F32, 2).expect_err("short");
        assert_eq!(e.to_string(), "recv buffer holds 60 bytes, but 16 × f32 needs 64");
    }

    fn op(recv: bool, addr: usize, len: usize, count: usize, peer: usize) -> P2pDesc {
        P2pDesc { recv, buf: dev(addr, len), count, dtype: DataType::F32, peer }
    }

    #[test]
    fn grouped_point_to_point_checks_each_op_and_every_overlap() {
        // A valid ring step: send to the next rank, receive from the previous; two sends may share bytes.
        let good = [op(false, 0x1000, 64, 16, 2), op(true, 0x2000, 64, 16, 0), op(false, 0x1000, 64, 16, 3)];
        assert_eq!(p2p_group(&SHAPE, &good), Ok(vec![64, 64, 64]));
        assert_eq!(p2p_group(&SHAPE, &[]), Ok(vec![]));
        let inner = |e: Result<Vec<usize>, InvalidArgument>| match e {
            Err(InvalidArgument::GroupOp { index, error }) => (index, *error),
            other => panic!("expected a GroupOp error, got {other:?}"),
        };
        let (i, e) = inner(p2p_group(&SHAPE, &[good[0], op(true, 0x2000, 64, 16, 1)]));
        assert_eq!((i, e), (1, InvalidArgument::SelfPeer { rank: 1 }));
        let (i, e) = inner(p2p_group(&SHAPE, &[op(false, 0x1000, 64, 16, 4)]));
        assert_eq!((i, e), (0, InvalidArgument::RankOutOfRange { what: "peer", rank: 4, world: 4 }));
        let (i, e) = inner(p2p_group(&SHAPE, &[good[0], good[1], op(true, 0x3000, 60, 16, 0)]));
        assert!(matches!((i, e), (2, InvalidArgument::BufferTooSmall { which: "recv", have: 60, need: 64, .. })));
        let host = BufferDesc { addr: 0x3000, len: 64, location: Location::Host };
        let (i, e) = inner(p2p_group(&SHAPE, &[P2pDesc { buf: host, ..good[0] }]));
        assert!(matches!((i, e), (0, InvalidArgument::WrongDevice { which: "send", .. })));
        // Two receives into overlapping bytes, whatever their order in the group.
        for ops in [
            [op(true, 0x2000, 64, 16, 0), op(true, 0x2020, 64, 16, 2)],
            [op(true, 0x2020, 64, 16, 2), op(true, 0x2000, 64, 16, 0)],
        ] {
            let e = p2p_group(&SHAPE, &ops).expect_err("receives overlap");
            assert!(matches!(e, InvalidArgument::GroupOverlap { first: 0, second: 1, .. }), "{e:?}");
        }
        // A receive into bytes another op sends, and a send that starts inside a receive.
        let e = p2p_group(&SHAPE, &[good[0], op(true, 0x1010, 64, 16, 0)]).expect_err("recv over a send");
        assert!(
            matches!(
                e,
                InvalidArgument::GroupOverlap { first: 0, first_kind: "send", second: 1, second_kind: "recv", .. }
            ),
            "{e:?}"
        );
        let e = p2p_group(&SHAPE, &[op(true, 0x1000, 64, 16, 0), op(false, 0x103c, 4, 1, 2)]).expect_err("send in");
        assert!(matches!(e, InvalidArgument::GroupOverlap { first: 0, second: 1, .. }), "{e:?}");
        // Only the touched bytes count: a receive right after the 64 bytes a send reads from a larger buffer.
        assert!(p2p_group(&SHAPE, &[op(false, 0x1000, 4096, 16, 0), op(true, 0x1040, 64, 16, 2)]).is_ok());
        // Zero-element receives touch nothing.
        assert!(p2p_group(&SHAPE, &[op(true, 0x1000, 64, 0, 0), op(true, 0x1000, 64, 0, 2)]).is_ok());
    }

    #[test]
    fn overlap_counts_only_touched_bytes() {
        // recv starts right after the 64 bytes the call reads from a larger send allocation.
        let sep = InOutDesc::Separate { send: dev(0x1000, 4096), recv: dev(0x1040, 64) };
        assert_eq!(all_reduce(&SHAPE, &sep, 16, DataType::F32, ReduceOp::Sum), Ok(64));
    }

    proptest::proptest! {
        /// Validation never panics and accepts exactly the calls whose buffers fit, align and do not overlap.
        #[test]
        fn all_reduce_matches_a_direct_model(
            saddr in 0usize..4096, slen in 0usize..512, raddr in 0usize..4096, rlen in 0usize..512,
            count in 0usize..200, d in 0usize..12, o in 0usize..5,
        ) {
            let dtype = DataType::ALL[d];
            let op = ReduceOp::ALL[o];
            let bufs = InOutDesc::Separate { send: dev(saddr, slen), recv: dev(raddr, rlen) };
            let got = all_reduce(&SHAPE, &bufs, count, dtype, op);
            let need = count * dtype.size_bytes();
            let sz = dtype.size_bytes();
            let overlap = need > 0 && saddr < raddr + need && raddr < saddr + need;
            let ok = (op != ReduceOp::Avg || dtype.is_float())
                && saddr % sz == 0 && raddr % sz == 0 && slen >= need && rlen >= need && !overlap;
            proptest::prop_assert_eq!(got.is_ok(), ok, "{:?}", got);
        }
    }
}
