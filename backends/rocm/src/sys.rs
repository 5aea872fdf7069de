//! Raw HIP runtime types and function-pointer types (the subset anyccl calls), as `hip_runtime_api.h` declares
//! them. No logic.
#![allow(non_camel_case_types)]
// Each function-pointer type below is named after the HIP function it types (`GetDeviceCount` is
// `hipGetDeviceCount`); their documentation is HIP's.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `hipError_t`.
pub type hipError_t = c_int;
/// `hipSuccess`.
pub const HIP_SUCCESS: hipError_t = 0;
/// `hipErrorNotReady`: queued work has not finished yet (`hipStreamQuery`).
pub const HIP_ERROR_NOT_READY: hipError_t = 600;
/// `hipErrorNoDevice`.
pub const HIP_ERROR_NO_DEVICE: hipError_t = 100;
/// `hipErrorPeerAccessAlreadyEnabled`.
pub const HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED: hipError_t = 704;
/// `hipErrorStreamCaptureUnsupported`: the call is not allowed while a stream is capturing.
pub const HIP_ERROR_STREAM_CAPTURE_UNSUPPORTED: hipError_t = 900;
/// `hipErrorStreamCaptureInvalidated`.
pub const HIP_ERROR_STREAM_CAPTURE_INVALIDATED: hipError_t = 901;
/// `hipStream_t`.
pub type hipStream_t = *mut c_void;
/// `hipEvent_t`.
pub type hipEvent_t = *mut c_void;
/// `hipGraph_t`.
pub type hipGraph_t = *mut c_void;
/// `hipGraphExec_t`.
pub type hipGraphExec_t = *mut c_void;
/// `hipModule_t`.
pub type hipModule_t = *mut c_void;
/// `hipFunction_t`.
pub type hipFunction_t = *mut c_void;
/// Bytes of `hipIpcMemHandle_t`.
pub const HIP_IPC_HANDLE_BYTES: usize = 64;

/// `hipIpcMemHandle_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct hipIpcMemHandle_t {
    /// Opaque bytes.
    pub reserved: [c_char; HIP_IPC_HANDLE_BYTES],
}

/// `hipStreamCaptureStatus`.
pub type hipStreamCaptureStatus = c_int;
/// Not capturing.
pub const HIP_STREAM_CAPTURE_STATUS_NONE: hipStreamCaptureStatus = 0;
/// Capturing.
pub const HIP_STREAM_CAPTURE_STATUS_ACTIVE: hipStreamCaptureStatus = 1;
/// Part of an invalidated capture.
pub const HIP_STREAM_CAPTURE_STATUS_INVALIDATED: hipStreamCaptureStatus = 2;
/// `hipStreamCaptureMode`.
pub type hipStreamCaptureMode = c_int;
/// `hipStreamCaptureModeGlobal`: every thread's unsafe calls are checked against the capture.
pub const HIP_STREAM_CAPTURE_MODE_GLOBAL: hipStreamCaptureMode = 0;
/// `hipStreamCaptureModeThreadLocal`: only this thread's unsafe calls are checked against the capture.
pub const HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL: hipStreamCaptureMode = 1;
/// `hipStreamCaptureModeRelaxed`: no call is checked against the capture.
pub const HIP_STREAM_CAPTURE_MODE_RELAXED: hipStreamCaptureMode = 2;
/// `hipStreamNonBlocking`.
pub const HIP_STREAM_NON_BLOCKING: c_uint = 1;
/// `hipMemcpyHostToDevice`.
pub const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
/// `hipMemcpyDeviceToHost`.
pub const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// `hipMemcpyDeviceToDevice`.
pub const HIP_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `hipIpcMemLazyEnablePeerAccess`.
pub const HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// `hipDeviceAttributeMultiprocessorCount`.
pub const HIP_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 63;

pub type GetDeviceCount = unsafe extern "C" fn(*mut c_int) -> hipError_t;
pub type SetDevice = unsafe extern "C" fn(c_int) -> hipError_t;
pub type GetDevice = unsafe extern "C" fn(*mut c_int) -> hipError_t;
pub type DeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> hipError_t;
/// `hipGetDeviceProperties(hipDeviceProp_t*, int)`; the struct's layout differs between HIP 5 and 6, so anyccl
/// passes a large zeroed buffer and reads only the `gcnArchName` string out of it (see `runtime::arch_of`).
pub type GetDeviceProperties = unsafe extern "C" fn(*mut c_void, c_int) -> hipError_t;
pub type RuntimeGetVersion = unsafe extern "C" fn(*mut c_int) -> hipError_t;
pub type GetErrorString = unsafe extern "C" fn(hipError_t) -> *const c_char;
pub type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> hipError_t;
/// `hipMemGetAddressRange(base, size, ptr)`: the allocation that contains `ptr`.
pub type MemGetAddressRange = unsafe extern "C" fn(*mut *mut c_void, *mut usize, *mut c_void) -> hipError_t;
pub type Free = unsafe extern "C" fn(*mut c_void) -> hipError_t;
/// `hipMemGetInfo(free, total)`: free and total memory of the current device in bytes.
pub type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> hipError_t;
pub type MemcpyAsync = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, hipStream_t) -> hipError_t;
pub type MemsetAsync = unsafe extern "C" fn(*mut c_void, c_int, usize, hipStream_t) -> hipError_t;
pub type StreamCreateWithFlags = unsafe extern "C" fn(*mut hipStream_t, c_uint) -> hipError_t;
pub type StreamDestroy = unsafe extern "C" fn(hipStream_t) -> hipError_t;
pub type StreamSynchronize = unsafe extern "C" fn(hipStream_t) -> hipError_t;
/// `hipStreamQuery`.
pub type StreamQuery = unsafe extern "C" fn(hipStream_t) -> hipError_t;
pub type StreamGetCaptureInfo = unsafe extern "C" fn(hipStream_t, *mut hipStreamCaptureStatus, *mut u64) -> hipError_t;
/// `hipThreadExchangeStreamCaptureMode(mode)`: sets the calling thread's capture interaction mode to `*mode` and
/// writes the previous one there.
pub type ThreadExchangeStreamCaptureMode = unsafe extern "C" fn(*mut hipStreamCaptureMode) -> hipError_t;
pub type StreamBeginCapture = unsafe extern "C" fn(hipStream_t, hipStreamCaptureMode) -> hipError_t;
pub type StreamEndCapture = unsafe extern "C" fn(hipStream_t, *mut hipGraph_t) -> hipError_t;
pub type GraphInstantiate =
    unsafe extern "C" fn(*mut hipGraphExec_t, hipGraph_t, *mut c_void, *mut c_char, usize) -> hipError_t;
pub type GraphLaunch = unsafe extern "C" fn(hipGraphExec_t, hipStream_t) -> hipError_t;
pub type GraphExecDestroy = unsafe extern "C" fn(hipGraphExec_t) -> hipError_t;
pub type GraphDestroy = unsafe extern "C" fn(hipGraph_t) -> hipError_t;
pub type IpcGetMemHandle = unsafe extern "C" fn(*mut hipIpcMemHandle_t, *mut c_void) -> hipError_t;
pub type IpcOpenMemHandle = unsafe extern "C" fn(*mut *mut c_void, hipIpcMemHandle_t, c_uint) -> hipError_t;
pub type IpcCloseMemHandle = unsafe extern "C" fn(*mut c_void) -> hipError_t;
pub type DeviceCanAccessPeer = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> hipError_t;
pub type DeviceEnablePeerAccess = unsafe extern "C" fn(c_int, c_uint) -> hipError_t;
pub type ModuleLoadData = unsafe extern "C" fn(*mut hipModule_t, *const c_void) -> hipError_t;
pub type ModuleUnload = unsafe extern "C" fn(hipModule_t) -> hipError_t;
pub type ModuleGetFunction = unsafe extern "C" fn(*mut hipFunction_t, hipModule_t, *const c_char) -> hipError_t;
pub type ModuleLaunchKernel = unsafe extern "C" fn(
    hipFunction_t,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    hipStream_t,
    *mut *mut c_void,
    *mut *mut c_void,
) -> hipError_t;
/// `hipStreamWriteValue32(stream, ptr, value, flags)`: writes `value` at device address `ptr` in stream order.
pub type StreamWriteValue32 = unsafe extern "C" fn(hipStream_t, *mut c_void, u32, c_uint) -> hipError_t;
/// `hipDeviceGetAttribute(value, attribute, device)`.
pub type DeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> hipError_t;
pub type EventCreate = unsafe extern "C" fn(*mut hipEvent_t) -> hipError_t;
pub type EventRecord = unsafe extern "C" fn(hipEvent_t, hipStream_t) -> hipError_t;
pub type EventSynchronize = unsafe extern "C" fn(hipEvent_t) -> hipError_t;
pub type EventElapsedTime = unsafe extern "C" fn(*mut f32, hipEvent_t, hipEvent_t) -> hipError_t;
pub type EventDestroy = unsafe extern "C" fn(hipEvent_t) -> hipError_t;
