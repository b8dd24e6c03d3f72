//! `starling-restorer`: writes out or runs the embedded static restorer.
//!
//! `starling-restorer --extract PATH` writes the static executable to PATH
//! (mode 0755). Without arguments it execs the static restorer in place,
//! keeping fds 0-4 (see `starling_image::abi::restorer`).

use std::io::Write;
use std::os::unix::fs::PermissionsExt;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--extract" {
        let path = &args[2];
        let result = std::fs::File::create(path)
            .and_then(|mut f| f.write_all(starling_restorer::RESTORER_ELF))
            .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)));
        if let Err(e) = result {
            eprintln!("starling-restorer: cannot write {path}: {e}");
            std::process::exit(1);
        }
        return;
    }
    if args.len() != 1 {
        eprintln!("usage: starling-restorer [--extract PATH]   (plan on fd 3, handler socket on fd 4: starling_image::abi::restorer)");
        std::process::exit(2);
    }
    let err = exec_embedded();
    eprintln!("starling-restorer: cannot exec embedded restorer: {err}");
    std::process::exit(1);
}

fn exec_embedded() -> std::io::Error {
    use std::os::fd::AsRawFd;
    let name = c"starling-restorer";
    // SAFETY: memfd_create with a valid C string; the fd is owned below.
    let fd = unsafe { libc_memfd_create(name.as_ptr(), 0) };
    if fd < 0 {
        return std::io::Error::last_os_error();
    }
    // SAFETY: fd was just created by us and is not owned elsewhere.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    if let Err(e) = file.write_all(starling_restorer::RESTORER_ELF) {
        return e;
    }
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("no NUL");
    let argv = [name.as_ptr(), std::ptr::null()];
    let envp = [std::ptr::null()];
    // SAFETY: argv/envp are NULL-terminated arrays of valid C strings.
    unsafe { libc_execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    std::io::Error::last_os_error()
}

extern "C" {
    #[link_name = "memfd_create"]
    fn libc_memfd_create(name: *const std::ffi::c_char, flags: u32) -> i32;
    #[link_name = "execve"]
    fn libc_execve(path: *const std::ffi::c_char, argv: *const *const std::ffi::c_char, envp: *const *const std::ffi::c_char) -> i32;
}
