//! The real CUDA driver behind [`crate::multicast::MulticastDriver`].
//!
//! Never exercised on the machines this project is tested on: NVLink multicast there can take a shared host out
//! of service, so `NCCL_NVLS_ENABLE=0` is set and the manager's gate refuses before any create call. As a second
//! interlock, [`CudaMulticastDriver::multicast_create`] itself refuses while `NCCL_NVLS_ENABLE=0`. POSIX-fd
//! handles only; FABRIC handles are refused with an error.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::multicast::{DriverError, McHandle, MemHandle, MulticastDriver, Shareable, ShareableKind};

/// The CUDA driver (through cudarc's dynamically loaded bindings) as a multicast driver.
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaMulticastDriver;

fn check(call: &'static str, r: sys::CUresult) -> Result<(), DriverError> {
    r.result().map_err(|e| DriverError {
        call,
        code: e.0 as i32,
        message: e.error_string().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default(),
    })
}

fn fd_kind(kind: ShareableKind, call: &'static str) -> Result<(), DriverError> {
    match kind {
        ShareableKind::PosixFd => Ok(()),
        ShareableKind::Fabric => Err(DriverError {
            call,
            code: sys::CUresult::CUDA_ERROR_NOT_SUPPORTED as i32,
            message: "FABRIC handles are not implemented by anyccl; use POSIX file descriptors".into(),
        }),
    }
}

/// Whether the environment forbids NVLS (`NCCL_NVLS_ENABLE=0`): the interlock `multicast_create` applies.
pub fn nvls_disabled(env: &dyn Fn(&str) -> Option<String>) -> bool {
    anyccl_core::caps::nvls_off_by_env(env).is_some()
}

fn prop(num_devices: usize, size: usize) -> sys::CUmulticastObjectProp {
    sys::CUmulticastObjectProp {
        numDevices: u32::try_from(num_devices).unwrap_or(u32::MAX),
        size,
        handleTypes: u64::from(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0),
        flags: 0,
    }
}

fn device(ordinal: i32) -> Result<sys::CUdevice, DriverError> {
    let mut d: sys::CUdevice = 0;
    // SAFETY: writes one device handle.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ordinal) })?;
    Ok(d)
}

impl MulticastDriver for CudaMulticastDriver {
    fn driver_version(&self) -> Result<i32, DriverError> {
        let mut v = 0;
        // SAFETY: writes one int.
        check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v) })?;
        Ok(v)
    }

    fn multicast_supported(&self, ordinal: i32) -> Result<bool, DriverError> {
        let dev = device(ordinal)?;
        let mut v = 0;
        // SAFETY: valid device; writes one int.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&mut v, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev)
        })?;
        Ok(v != 0)
    }

    fn multicast_granularity(&self, num_devices: usize, size: usize, recommended: bool) -> Result<usize, DriverError> {
        let p = prop(num_devices, size);
        let mut g = 0usize;
        let flag = if recommended {
            sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_RECOMMENDED
        } else {
            sys::CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM
        };
        // SAFETY: valid property struct; writes one size.
        check("cuMulticastGetGranularity", unsafe { sys::cuMulticastGetGranularity(&mut g, &p, flag) })?;
        Ok(g)
    }

    fn multicast_create(&self, num_devices: usize, size: usize, kind: ShareableKind) -> Result<McHandle, DriverError> {
        fd_kind(kind, "cuMulticastCreate")?;
        let env = anyccl_core::env::CheckedEnv::new();
        let disabled = nvls_disabled(&|k| env.get(k));
        if let Err(e) = env.finish() {
            return Err(DriverError {
                call: "cuMulticastCreate",
                code: sys::CUresult::CUDA_ERROR_NOT_PERMITTED as i32,
                message: format!("refused: {e}"),
            });
        }
        if disabled {
            return Err(DriverError {
                call: "cuMulticastCreate",
                code: sys::CUresult::CUDA_ERROR_NOT_PERMITTED as i32,
                message: "refused: NCCL_NVLS_ENABLE=0".into(),
            });
        }
        let p = prop(num_devices, size);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid property struct; writes one handle.
        check("cuMulticastCreate", unsafe { sys::cuMulticastCreate(&mut h, &p) })?;
        Ok(McHandle(h))
    }

    fn export_shareable(&self, handle: McHandle, kind: ShareableKind) -> Result<Shareable, DriverError> {
        fd_kind(kind, "cuMemExportToShareableHandle")?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: writes one int, the new descriptor, which the returned Shareable owns.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle.0,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        Ok(Shareable::PosixFd(fd))
    }

    fn import_shareable(&self, shareable: &Shareable) -> Result<McHandle, DriverError> {
        let Shareable::PosixFd(fd) = shareable else {
            return Err(fd_kind(ShareableKind::Fabric, "cuMemImportFromShareableHandle")
                .err()
                .unwrap_or(DriverError { call: "cuMemImportFromShareableHandle", code: 0, message: String::new() }));
        };
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX descriptors the driver takes the fd value as the pointer argument and only reads it.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                *fd as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(McHandle(h))
    }

    fn close_shareable(&self, shareable: &Shareable) -> Result<(), DriverError> {
        if let Shareable::PosixFd(fd) = shareable {
            use std::os::fd::FromRawFd;
            // SAFETY: the Shareable owns this descriptor (from export or a peer) and the manager closes it once.
            drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(*fd) });
        }
        Ok(())
    }

    fn release(&self, handle: McHandle) -> Result<(), DriverError> {
        // SAFETY: releases one reference the manager holds.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) })
    }

    fn multicast_add_device(&self, mc: McHandle, ordinal: i32) -> Result<(), DriverError> {
        let dev = device(ordinal)?;
        // SAFETY: valid handle and device.
        check("cuMulticastAddDevice", unsafe { sys::cuMulticastAddDevice(mc.0, dev) })
    }

    fn multicast_bind_mem(
        &self,
        mc: McHandle,
        mc_offset: usize,
        mem: MemHandle,
        mem_offset: usize,
        size: usize,
    ) -> Result<(), DriverError> {
        // SAFETY: valid handles; the manager checked offsets against the object's size.
        check("cuMulticastBindMem", unsafe { sys::cuMulticastBindMem(mc.0, mc_offset, mem.0, mem_offset, size, 0) })
    }

    fn multicast_unbind(&self, mc: McHandle, ordinal: i32, mc_offset: usize, size: usize) -> Result<(), DriverError> {
        let dev = device(ordinal)?;
        // SAFETY: unbinds a range bound earlier.
        check("cuMulticastUnbind", unsafe { sys::cuMulticastUnbind(mc.0, dev, mc_offset, size) })
    }

    fn address_reserve(&self, size: usize, alignment: usize) -> Result<u64, DriverError> {
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: writes the reserved base.
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut va, size, alignment, 0, 0) })?;
        Ok(va)
    }

    fn map(&self, va: u64, size: usize, offset: usize, handle: McHandle) -> Result<(), DriverError> {
        // SAFETY: maps a reserved range; the manager passes offset 0 for multicast handles.
        check("cuMemMap", unsafe { sys::cuMemMap(va, size, offset, handle.0, 0) })
    }

    fn set_access(&self, va: u64, size: usize, ordinal: i32) -> Result<(), DriverError> {
        let desc = sys::CUmemAccessDesc {
            location: crate::driver::device_location(ordinal),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one descriptor.
        check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(va, size, &desc, 1) })
    }

    fn unmap(&self, va: u64, size: usize) -> Result<(), DriverError> {
        // SAFETY: unmaps a range mapped by `map`.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(va, size) })
    }

    fn address_free(&self, va: u64, size: usize) -> Result<(), DriverError> {
        // SAFETY: frees a range reserved by `address_reserve`, after unmapping.
        check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(va, size) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interlock_reads_nccl_nvls_enable() {
        assert!(nvls_disabled(&|k| (k == "NCCL_NVLS_ENABLE").then(|| "0".to_owned())));
        assert!(nvls_disabled(&|k| (k == "NCCL_NVLS_ENABLE").then(|| " 0 ".to_owned())));
        assert!(!nvls_disabled(&|k| (k == "NCCL_NVLS_ENABLE").then(|| "1".to_owned())));
        assert!(!nvls_disabled(&|_| None));
    }

    #[test]
    fn fabric_handles_are_refused_before_any_driver_call() {
        // No driver is needed: the refusal comes first (CI has no libcuda).
        let e = CudaMulticastDriver.multicast_create(2, 1 << 21, ShareableKind::Fabric).expect_err("fabric");
        assert!(e.message.contains("FABRIC"), "{e}");
        let e = CudaMulticastDriver.import_shareable(&Shareable::Fabric([0; 64])).expect_err("fabric");
        assert!(e.message.contains("FABRIC"), "{e}");
    }
}
