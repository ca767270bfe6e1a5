//! The seccomp filter: a deny list answered with `EPERM`, installed last, right before
//! `execve`.
//!
//! Two programs are stacked. A hand-written prelude kills any syscall from a foreign
//! architecture (i386 via `int 0x80`), refuses x32 numbers, and answers `clone3` with
//! `ENOSYS` (its flags sit behind a pointer the filter cannot read, so libc falls back to
//! `clone`, whose flags it can). The deny list is compiled by `seccompiler`.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

/// Syscalls refused outright.
const DENIED: &[i64] = &[
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kcmp,
    libc::SYS_pidfd_getfd,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_vhangup,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_uselib,
];

/// `clone` flags that would create namespaces.
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// Terminal ioctls that inject input into (or reconfigure) a controlling terminal.
const DENIED_IOCTLS: &[u64] = &[libc::TIOCSTI, libc::TIOCLINUX];

/// The deny-list program.
pub(crate) fn deny_list() -> Result<BpfProgram, String> {
    let e = |e: seccompiler::BackendError| e.to_string();
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|&flag| {
            SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )
            .and_then(|c| SeccompRule::new(vec![c]))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(e)?;
    rules.insert(libc::SYS_clone, clone_rules);
    let ioctl_rules = DENIED_IOCTLS
        .iter()
        .map(|&request| {
            SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, request)
                .and_then(|c| SeccompRule::new(vec![c]))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(e)?;
    rules.insert(libc::SYS_ioctl, ioctl_rules);
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(e)?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(e)?;
    BpfProgram::try_from(filter).map_err(e)
}

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JEQ_K: u16 = 0x15;
const BPF_JGE_K: u16 = 0x35;
const BPF_RET_K: u16 = 0x06;
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const OFFSET_NR: u32 = 0;
const OFFSET_ARCH: u32 = 4;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
#[cfg(target_arch = "x86_64")]
const X32_BIT: u32 = 0x4000_0000;
#[cfg(not(target_arch = "x86_64"))]
const X32_BIT: u32 = u32::MAX;

fn insn(code: u16, jt: u8, jf: u8, k: u32) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// The prelude: foreign architectures killed, x32 refused, `clone3` answered `ENOSYS`.
pub(crate) fn prelude() -> BpfProgram {
    let clone3 = u32::try_from(libc::SYS_clone3).unwrap_or(u32::MAX);
    vec![
        insn(BPF_LD_W_ABS, 0, 0, OFFSET_ARCH),
        insn(BPF_JEQ_K, 1, 0, AUDIT_ARCH),
        insn(BPF_RET_K, 0, 0, RET_KILL_PROCESS),
        insn(BPF_LD_W_ABS, 0, 0, OFFSET_NR),
        insn(BPF_JGE_K, 0, 1, X32_BIT),
        insn(BPF_RET_K, 0, 0, RET_ERRNO | libc::EPERM as u32),
        insn(BPF_JEQ_K, 0, 1, clone3),
        insn(BPF_RET_K, 0, 0, RET_ERRNO | libc::ENOSYS as u32),
        insn(BPF_RET_K, 0, 0, RET_ALLOW),
    ]
}

/// Installs both programs on the calling (single) thread. Needs no-new-privs set.
pub(crate) fn install() -> Result<(), String> {
    let deny = deny_list()?;
    seccompiler::apply_filter(&prelude()).map_err(|e| format!("prelude: {e}"))?;
    seccompiler::apply_filter(&deny).map_err(|e| format!("deny list: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deny_list_compiles_and_covers_the_issue_list() {
        let program = deny_list().unwrap();
        assert!(program.len() > DENIED.len());
        for nr in [
            libc::SYS_ptrace,
            libc::SYS_mount,
            libc::SYS_bpf,
            libc::SYS_keyctl,
            libc::SYS_setns,
            libc::SYS_unshare,
            libc::SYS_kexec_file_load,
        ] {
            assert!(DENIED.contains(&nr));
        }
        assert_eq!(prelude().len(), 9);
    }
}
