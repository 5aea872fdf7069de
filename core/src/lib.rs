//! anyccl-core: the vendor-neutral heart of anyccl.
//!
//! Everything that does not depend on a vendor lives here and is written once:
//! - [`DataType`], [`ReduceOp`] and which pairs are valid ([`dtype`]);
//! - the capability model: [`Capabilities`] and a [`CapabilityReport`] that says, for every flag, whether it is
//!   enabled and, if not, the concrete [`Reason`] ([`caps`]);
//! - the error types ([`Error`], [`InvalidArgument`]) and the one checked reader of environment variables
//!   ([`env`](mod@env));
//! - the traits a backend implements ([`CommBackend`], [`MemoryRuntime`]) and the [`Communicator`] front-end that
//!   validates every call and picks the all-reduce algorithm before the backend sees it ([`comm`], [`validate`]);
//! - the validated call descriptions only the front-end makes ([`args`]) and the [`Bootstrap`] trait through
//!   which ranks exchange setup bytes ([`bootstrap`]);
//! - the all-reduce algorithm family and its selector ([`algo`], [`selector`]);
//! - the fused all-reduce + residual add + RMSNorm: its description, checks and host arithmetic ([`fused`]);
//! - the graph-capture rules every GPU runtime follows ([`capture`]) and background teardown ([`teardown`]);
//! - with the `conformance` feature, the conformance suite every backend runs ([`conformance`]).
#![forbid(unsafe_code)]

pub mod algo;
pub mod args;
pub mod bootstrap;
pub mod caps;
pub mod capture;
pub mod comm;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod dtype;
pub mod env;
pub mod error;
pub mod fused;
pub mod runtime;
pub mod selector;
pub mod teardown;
pub mod text;
pub mod topology;
pub mod units;
pub mod validate;

pub use algo::{Algorithm, Vendor};
pub use bootstrap::Bootstrap;
pub use caps::{Capabilities, CapabilityReport, CapabilityState, Reason};
pub use comm::{AllReduceOutcome, CommBackend, Communicator, GraphRegistration, InOut, P2pOp};
pub use dtype::{DataType, Element, ReduceOp};
pub use error::{Error, InvalidArgument, Result};
pub use fused::{RmsNormForm, RmsNormOutput, RmsNormSelection, RmsNormSpec};
pub use runtime::{
    check_allocation, check_non_null, round_allocation, BufferDesc, CaptureMode, Location, MemoryRuntime,
};
pub use selector::{Selection, SelectionQuery, Selector, SelectorTable};
pub use teardown::Teardown;
