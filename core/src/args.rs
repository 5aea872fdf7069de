//! Validated call descriptions: the proof that a collective's arguments passed the checks of
//! [`Communicator`](crate::Communicator).
//!
//! A backend's collective methods ([`crate::CommBackend::all_reduce`] and the others)
//! take one of these instead of loose buffers and counts. They have private fields and no public constructor: only
//! the [`Communicator`](crate::Communicator) front-end of this crate makes them, after [`crate::validate`] has
//! accepted the call against the very backend that receives it (its rank, world and memory location). Each carries
//! the buffers it validated, so a backend may rely on it (for example to enter `unsafe` for a vendor call) without
//! checking again: a short buffer with a large count cannot reach a backend except through the front-end, which
//! refuses it with [`Error::InvalidArgument`](crate::Error::InvalidArgument).
//!
//! The tokens are typed by the backend (`AllReduceArgs<'_, CudaComm>`), so a token made for one backend type
//! cannot be handed to another whose shape was never checked.
//!
//! Code outside this crate cannot make one:
//!
//! ```compile_fail,E0624
//! use anyccl_core::comm::{AllReduceArgs, AllReduceCall, BufOf, CommBackend, InOut, StreamOf};
//! use anyccl_core::{Algorithm, DataType, ReduceOp};
//!
//! // The old out-of-bounds route: a short buffer described as 2^30 elements.
//! fn forge<'a, B: CommBackend>(bufs: InOut<'a, BufOf<B>>, stream: &'a StreamOf<B>) -> AllReduceArgs<'a, B> {
//!     let (count, dtype, op) = (1 << 30, DataType::F32, ReduceOp::Sum);
//!     let call = AllReduceCall { count, dtype, op, bytes: 4 << 30, in_place: true, capturing: false, bufs: None };
//!     AllReduceArgs::new(bufs, stream, call, todo!(), Algorithm::Ccl, todo!())
//! }
//! ```
//!
//! nor fill its fields by hand:
//!
//! ```compile_fail,E0451
//! use anyccl_core::comm::{AllGatherArgs, CommBackend, InOut, StreamOf, BufOf};
//! use anyccl_core::DataType;
//!
//! fn forge<'a, B: CommBackend>(bufs: InOut<'a, BufOf<B>>, stream: &'a StreamOf<B>) -> AllGatherArgs<'a, B> {
//!     AllGatherArgs { bufs, stream, count: 1 << 30, dtype: DataType::F32, bytes: 4 << 30 }
//! }
//! ```
//!
//! nor can a grouped point-to-point call be described with sizes of one's choosing:
//!
//! ```compile_fail,E0624
//! use anyccl_core::comm::{BufOf, CommBackend, P2pArgs, StreamOf};
//! use anyccl_core::P2pOp;
//!
//! fn forge<'a, 'b, B: CommBackend>(ops: &'a mut [P2pOp<'b, BufOf<B>>], s: &'a StreamOf<B>) -> P2pArgs<'a, 'b, B> {
//!     P2pArgs::new(ops, s, vec![1 << 30])
//! }
//! ```
//!
//! and the backend is no longer handed out mutably by the communicator (`backend_mut` is gone):
//!
//! ```compile_fail,E0599
//! use anyccl_core::{CommBackend, Communicator};
//!
//! fn reach<B: CommBackend>(comm: &mut Communicator<B>) -> &mut B {
//!     comm.backend_mut()
//! }
//! ```
//!
//! The front door, for contrast, compiles (the same imports, a generic backend):
//!
//! ```
//! use anyccl_core::comm::{BufOf, CommBackend, InOut, StreamOf};
//! use anyccl_core::{Communicator, DataType, ReduceOp, Result};
//!
//! fn sum<B: CommBackend>(comm: &mut Communicator<B>, buf: &mut BufOf<B>, n: usize, s: &StreamOf<B>) -> Result<()> {
//!     comm.all_reduce(InOut::InPlace(buf), n, DataType::F32, ReduceOp::Sum, s).map(|_| ())
//! }
//! ```

use crate::algo::Algorithm;
use crate::comm::{AllReduceCall, BufOf, CommBackend, InOut, P2pOp, StreamOf};
use crate::dtype::{DataType, ReduceOp};

/// A validated all-reduce: the buffers, the stream, the call as the selector saw it (one capture query, made by
/// the front-end on this stream), the algorithm it chose (eligible for this call) and the backend's plan for
/// running it ([`CommBackend::Plan`], what the backend's eligibility answer returned).
pub struct AllReduceArgs<'a, B: CommBackend + ?Sized> {
    bufs: InOut<'a, BufOf<B>>,
    stream: &'a StreamOf<B>,
    call: AllReduceCall,
    reduction: B::Reduction,
    algorithm: Algorithm,
    plan: B::Plan,
}

impl<'a, B: CommBackend + ?Sized> AllReduceArgs<'a, B> {
    /// Made by the `Communicator` once the call is validated and `algorithm` found eligible for `call`, with the
    /// plan that eligibility answer returned.
    pub(crate) fn new(
        bufs: InOut<'a, BufOf<B>>,
        stream: &'a StreamOf<B>,
        call: AllReduceCall,
        reduction: B::Reduction,
        algorithm: Algorithm,
        plan: B::Plan,
    ) -> Self {
        AllReduceArgs { bufs, stream, call, reduction, algorithm, plan }
    }

    /// The buffers: each holds at least [`Self::bytes`] bytes of this rank's memory; separate ones do not overlap.
    pub fn bufs(&self) -> &InOut<'a, BufOf<B>> {
        &self.bufs
    }

    /// The buffers, consuming the description.
    pub fn into_bufs(self) -> InOut<'a, BufOf<B>> {
        self.bufs
    }

    /// The stream the call is ordered on.
    pub fn stream(&self) -> &'a StreamOf<B> {
        self.stream
    }

    /// The call as the selector saw it.
    pub fn call(&self) -> &AllReduceCall {
        &self.call
    }

    /// The algorithm chosen (eligible for this call on this backend).
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The backend's plan for running [`Self::algorithm`] on this call: what its
    /// [`CommBackend::allreduce_eligible`] returned when the algorithm was found eligible (remembered with the
    /// decision while the backend's eligibility is unchanged).
    pub fn plan(&self) -> &B::Plan {
        &self.plan
    }

    /// Element count.
    pub fn count(&self) -> usize {
        self.call.count
    }

    /// Element type.
    pub fn dtype(&self) -> DataType {
        self.call.dtype
    }

    /// Operator (a valid pair with the type, for core and for this backend).
    pub fn op(&self) -> ReduceOp {
        self.call.op
    }

    /// What the backend derived from the (type, operator) pair when it accepted it
    /// ([`CommBackend::check_reduction`]).
    pub fn reduction(&self) -> B::Reduction {
        self.reduction
    }

    /// Message size in bytes (`count × dtype size`, without overflow).
    pub fn bytes(&self) -> usize {
        self.call.bytes
    }

    /// Whether the stream was being captured when the call was made (queried once, by the front-end).
    pub fn capturing(&self) -> bool {
        self.call.capturing
    }
}

/// Declares a validated description of a buffered collective other than all-reduce.
macro_rules! collective_args {
    (
        $(#[$doc:meta])*
        $name:ident, bytes: $bytes_doc:literal $(, $field:ident : $ty:ty => $field_doc:literal)*
    ) => {
        $(#[$doc])*
        pub struct $name<'a, B: CommBackend + ?Sized> {
            bufs: InOut<'a, BufOf<B>>,
            stream: &'a StreamOf<B>,
            count: usize,
            dtype: DataType,
            bytes: usize,
            $($field: $ty,)*
        }

        impl<'a, B: CommBackend + ?Sized> $name<'a, B> {
            /// Made by the `Communicator` once the call is validated.
            #[allow(clippy::too_many_arguments)]
            pub(crate) fn new(
                bufs: InOut<'a, BufOf<B>>,
                stream: &'a StreamOf<B>,
                count: usize,
                dtype: DataType,
                bytes: usize,
                $($field: $ty,)*
            ) -> Self {
                $name { bufs, stream, count, dtype, bytes, $($field,)* }
            }

            /// The buffers, validated for this call on this rank.
            pub fn bufs(&self) -> &InOut<'a, BufOf<B>> {
                &self.bufs
            }

            /// The buffers, consuming the description.
            pub fn into_bufs(self) -> InOut<'a, BufOf<B>> {
                self.bufs
            }

            /// The stream the call is ordered on.
            pub fn stream(&self) -> &'a StreamOf<B> {
                self.stream
            }

            /// Element count (per rank).
            pub fn count(&self) -> usize {
                self.count
            }

            /// Element type.
            pub fn dtype(&self) -> DataType {
                self.dtype
            }

            #[doc = $bytes_doc]
            pub fn bytes(&self) -> usize {
                self.bytes
            }

            $(
                #[doc = $field_doc]
                pub fn $field(&self) -> $ty {
                    self.$field
                }
            )*
        }
    };
}

collective_args!(
    /// A validated all-gather: the input holds `count` elements, the output `world × count`.
    AllGatherArgs, bytes: "The output's size in bytes (`world × count` elements, without overflow)."
);

collective_args!(
    /// A validated reduce-scatter: the input holds `world × count` elements, the output `count`.
    ReduceScatterArgs, bytes: "The input's size in bytes (`world × count` elements, without overflow).",
    op: ReduceOp => "Operator (a valid pair with the type, for core and for this backend).",
    reduction: B::Reduction => "What the backend derived from the (type, operator) pair when it accepted it."
);

collective_args!(
    /// A validated broadcast: both buffers hold `count` elements; `root` is a rank of the communicator.
    BroadcastArgs, bytes: "Message size in bytes (`count` elements, without overflow).",
    root: usize => "The rank whose data is sent (below the world size)."
);

collective_args!(
    /// A validated reduce: both buffers hold `count` elements; `root` is a rank of the communicator.
    ReduceArgs, bytes: "Message size in bytes (`count` elements, without overflow).",
    op: ReduceOp => "Operator (a valid pair with the type, for core and for this backend).",
    reduction: B::Reduction => "What the backend derived from the (type, operator) pair when it accepted it.",
    root: usize => "The rank that receives the result (below the world size)."
);

/// Declares a validated description of a point-to-point call.
macro_rules! p2p_args {
    ($(#[$doc:meta])* $name:ident, $buf:ty, $peer_doc:literal) => {
        $(#[$doc])*
        pub struct $name<'a, B: CommBackend + ?Sized> {
            buf: $buf,
            stream: &'a StreamOf<B>,
            count: usize,
            dtype: DataType,
            bytes: usize,
            peer: usize,
        }

        impl<'a, B: CommBackend + ?Sized> $name<'a, B> {
            /// Made by the `Communicator` once the call is validated.
            pub(crate) fn new(
                buf: $buf,
                stream: &'a StreamOf<B>,
                count: usize,
                dtype: DataType,
                bytes: usize,
                peer: usize,
            ) -> Self {
                $name { buf, stream, count, dtype, bytes, peer }
            }

            /// The buffer, consuming the description; it holds at least [`Self::bytes`] bytes of this rank's
            /// memory.
            pub fn into_buf(self) -> $buf {
                self.buf
            }

            /// The stream the call is ordered on.
            pub fn stream(&self) -> &'a StreamOf<B> {
                self.stream
            }

            /// Element count.
            pub fn count(&self) -> usize {
                self.count
            }

            /// Element type.
            pub fn dtype(&self) -> DataType {
                self.dtype
            }

            /// Message size in bytes (`count` elements, without overflow).
            pub fn bytes(&self) -> usize {
                self.bytes
            }

            #[doc = $peer_doc]
            pub fn peer(&self) -> usize {
                self.peer
            }
        }
    };
}

p2p_args!(
    /// A validated send of `count` elements to another rank.
    SendArgs,
    &'a BufOf<B>,
    "The receiving rank (another rank of the communicator)."
);

p2p_args!(
    /// A validated receive of `count` elements from another rank.
    RecvArgs,
    &'a mut BufOf<B>,
    "The sending rank (another rank of the communicator)."
);

impl<'a, B: CommBackend + ?Sized> SendArgs<'a, B> {
    /// The buffer.
    pub fn buf(&self) -> &'a BufOf<B> {
        self.buf
    }
}

impl<B: CommBackend + ?Sized> RecvArgs<'_, B> {
    /// The buffer.
    pub fn buf(&self) -> &BufOf<B> {
        self.buf
    }
}

/// A validated grouped point-to-point call ([`crate::Communicator::p2p`]): every operation passed the checks of a
/// single send or receive, no receive buffer overlaps another operation's bytes, and the group is not empty. The
/// backend runs the operations as one group ([`CommBackend::p2p`]): each rank's group completes whatever the order
/// of its operations, as long as every send has its matching receive in the peer's group.
pub struct P2pArgs<'a, 'b, B: CommBackend + ?Sized> {
    ops: &'a mut [P2pOp<'b, BufOf<B>>],
    stream: &'a StreamOf<B>,
    bytes: Vec<usize>,
}

/// One operation of a [`P2pArgs`], as the validated description of a single send or receive.
pub enum P2pItem<'r, B: CommBackend + ?Sized> {
    /// A send.
    Send(SendArgs<'r, B>),
    /// A receive.
    Recv(RecvArgs<'r, B>),
}

impl<B: CommBackend + ?Sized> P2pItem<'_, B> {
    /// The other rank.
    pub fn peer(&self) -> usize {
        match self {
            P2pItem::Send(s) => s.peer(),
            P2pItem::Recv(r) => r.peer(),
        }
    }

    /// `"send"` or `"recv"`.
    pub fn kind(&self) -> &'static str {
        match self {
            P2pItem::Send(_) => "send",
            P2pItem::Recv(_) => "recv",
        }
    }
}

impl<'a, 'b, B: CommBackend + ?Sized> P2pArgs<'a, 'b, B> {
    /// Made by the `Communicator` once every operation is validated; `bytes[i]` is operation `i`'s size.
    pub(crate) fn new(ops: &'a mut [P2pOp<'b, BufOf<B>>], stream: &'a StreamOf<B>, bytes: Vec<usize>) -> Self {
        P2pArgs { ops, stream, bytes }
    }

    /// Number of operations (at least one).
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Always false: the front-end does not hand an empty group to a backend.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The stream the group is ordered on.
    pub fn stream(&self) -> &'a StreamOf<B> {
        self.stream
    }

    /// The operations in the caller's order, each as a validated single send or receive (ordered on
    /// [`Self::stream`]). Call it again for another pass.
    pub fn items(&mut self) -> impl Iterator<Item = P2pItem<'_, B>> + use<'_, 'a, 'b, B> {
        let stream = self.stream;
        self.ops.iter_mut().zip(self.bytes.iter()).map(move |(op, &bytes)| match op {
            P2pOp::Send { buf, count, dtype, peer } => {
                P2pItem::Send(SendArgs::new(*buf, stream, *count, *dtype, bytes, *peer))
            }
            P2pOp::Recv { buf, count, dtype, peer } => {
                P2pItem::Recv(RecvArgs::new(&mut **buf, stream, *count, *dtype, bytes, *peer))
            }
        })
    }
}
