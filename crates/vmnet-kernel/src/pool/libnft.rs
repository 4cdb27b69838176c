//! nft JSON through the system's libnftables (`libnftables.so.1`, Debian package `libnftables1`,
//! which the `nftables` package depends on), loaded at run time with `dlopen`.
//!
//! # Design
//! One context per target namespace, created on a thread that entered that namespace, so its
//! netlink socket belongs there for the context's whole life: later commands from any thread act
//! on that namespace. The socket stays open, which is what makes a per-instance batch cost well
//! under a millisecond: a fresh `nft` process pays 2–3 ms to start and about 10 ms to close a
//! socket that deleted anything. Output and errors are buffered, so a refused batch returns
//! nft's own message. One batch is one kernel transaction.
//!
//! # Limitations
//! Needs `libnftables.so.1` (nftables 1.0.x) on the host; the JSON input parser is selected by
//! the JSON output flag, as in nftables 1.0.6.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Errors of the libnftables binding.
#[derive(Debug, thiserror::Error)]
pub enum LibNftError {
    /// The library or one of its symbols could not be loaded.
    #[error("cannot load libnftables.so.1: {0}")]
    Load(String),
    /// `nft_ctx_new` returned NULL.
    #[error("libnftables: cannot create a context")]
    Context,
    /// The namespace could not be entered to open the context.
    #[error("libnftables: cannot open a context in the namespace")]
    Netns(#[source] crate::netns::NetnsError),
    /// The command text contains a NUL byte.
    #[error("nft command contains a NUL byte")]
    Nul,
    /// nft refused the batch; the message is nft's error output.
    #[error("nft refused the batch (status {status}): {message}")]
    Refused {
        /// The return value of `nft_run_cmd_from_buffer`.
        status: i32,
        /// nft's error text.
        message: String,
    },
}

type CtxNew = unsafe extern "C" fn(c_uint) -> *mut c_void;
type CtxFree = unsafe extern "C" fn(*mut c_void);
type SetFlags = unsafe extern "C" fn(*mut c_void, c_uint);
type Buffer = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetBuffer = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type RunCmd = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;

const NFT_CTX_OUTPUT_JSON: c_uint = 1 << 4;

struct Api {
    ctx_new: CtxNew,
    ctx_free: CtxFree,
    output_set_flags: SetFlags,
    buffer_output: Buffer,
    buffer_error: Buffer,
    get_output: GetBuffer,
    get_error: GetBuffer,
    run_cmd: RunCmd,
}

fn load() -> Result<Api, LibNftError> {
    // SAFETY: dlopen with a constant, NUL-terminated name; the handle is never closed, so the
    // symbols stay valid for the process lifetime.
    let handle = unsafe {
        libc::dlopen(
            c"libnftables.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    if handle.is_null() {
        return Err(LibNftError::Load(
            "dlopen failed (is the libnftables1 package installed?)".into(),
        ));
    }
    let sym = |name: &CStr| -> Result<*mut c_void, LibNftError> {
        // SAFETY: `handle` is a live dlopen handle and `name` is NUL-terminated.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if p.is_null() {
            Err(LibNftError::Load(format!("missing symbol {name:?}")))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol is the libnftables function of that name; the function pointer types
    // match the prototypes in <nftables/libnftables.h> (nftables 1.0.x).
    unsafe {
        Ok(Api {
            ctx_new: std::mem::transmute::<*mut c_void, CtxNew>(sym(c"nft_ctx_new")?),
            ctx_free: std::mem::transmute::<*mut c_void, CtxFree>(sym(c"nft_ctx_free")?),
            output_set_flags: std::mem::transmute::<*mut c_void, SetFlags>(sym(
                c"nft_ctx_output_set_flags",
            )?),
            buffer_output: std::mem::transmute::<*mut c_void, Buffer>(sym(
                c"nft_ctx_buffer_output",
            )?),
            buffer_error: std::mem::transmute::<*mut c_void, Buffer>(sym(c"nft_ctx_buffer_error")?),
            get_output: std::mem::transmute::<*mut c_void, GetBuffer>(sym(
                c"nft_ctx_get_output_buffer",
            )?),
            get_error: std::mem::transmute::<*mut c_void, GetBuffer>(sym(
                c"nft_ctx_get_error_buffer",
            )?),
            run_cmd: std::mem::transmute::<*mut c_void, RunCmd>(sym(c"nft_run_cmd_from_buffer")?),
        })
    }
}

static API: std::sync::OnceLock<Result<Api, String>> = std::sync::OnceLock::new();

fn api() -> Result<&'static Api, LibNftError> {
    API.get_or_init(|| load().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| LibNftError::Load(e.clone()))
}

/// libnftables 1.0.x keeps process-wide state (datatype tables, symbol tables loaded by
/// `nft_ctx_new`, buffers used while printing JSON) that is not safe to touch from two threads at
/// once, even through different contexts: two kernel tests running in parallel aborted inside
/// `set_dtype_json` (`json.c:71: Assertion '__out' failed`). Every call into the library holds
/// this lock.
static LIB_LOCK: Mutex<()> = Mutex::new(());

fn lib_lock() -> std::sync::MutexGuard<'static, ()> {
    LIB_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

struct Ctx(*mut c_void);

// SAFETY: a libnftables context is plain heap state plus a netlink socket; it is only ever used
// by one thread at a time (it lives inside a Mutex in `LibNft`).
unsafe impl Send for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        let ctx = Ctx(std::mem::replace(&mut self.0, std::ptr::null_mut()));
        if ctx.0.is_null() {
            return;
        }
        // Freed by the reaper, later (see `reaper`); where it cannot be handed over (the
        // thread could not be started), here.
        if let Err(std::sync::mpsc::SendError((_, ctx))) = reaper().send((Instant::now(), ctx)) {
            free_now(&ctx);
            std::mem::forget(ctx);
        }
    }
}

/// Frees the context `ctx` points to (holding the library lock).
fn free_now(ctx: &Ctx) {
    if let Ok(api) = api() {
        let _lib = lib_lock();
        // SAFETY: the pointer came from nft_ctx_new and is freed exactly once (the callers
        // forget or null the `Ctx` afterwards).
        unsafe { (api.ctx_free)(ctx.0) };
    }
}

/// How long a dropped context waits before the reaper frees it.
const REAP_DELAY: Duration = Duration::from_millis(25);

/// The thread that frees dropped contexts [`REAP_DELAY`] after their drop.
///
/// Freeing a context closes its netfilter socket, and the kernel makes a closing socket wait
/// until every pending nf_tables release is done, an RCU grace period after any deletion
/// (10–15 ms here; `nft_rcv_nl_event` flushes the release work). A transaction that deleted a
/// rule or an element would pay that wait in its own apply, and an immediate free in the
/// background would hold the library lock through it. After the delay the releases are
/// usually done, the close is quick, and nothing waits for it.
fn reaper() -> &'static std::sync::mpsc::Sender<(Instant, Ctx)> {
    static REAPER: std::sync::OnceLock<std::sync::mpsc::Sender<(Instant, Ctx)>> =
        std::sync::OnceLock::new();
    REAPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<(Instant, Ctx)>();
        let started = std::thread::Builder::new()
            .name("libnft-reaper".into())
            .spawn(move || {
                for (dropped, ctx) in rx {
                    if let Some(wait) = REAP_DELAY.checked_sub(dropped.elapsed()) {
                        std::thread::sleep(wait);
                    }
                    free_now(&ctx);
                    std::mem::forget(ctx);
                }
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "cannot start the libnftables reaper; contexts are freed at once");
        }
        tx
    })
}

fn read(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libnftables returns a NUL-terminated buffer owned by the context, valid until the
    // next command; we copy it at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A libnftables context bound to one network namespace.
pub struct LibNft {
    ctx: Mutex<Ctx>,
}

impl std::fmt::Debug for LibNft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LibNft")
    }
}

impl LibNft {
    /// A context in the calling thread's current namespace (use on a thread, or in a process,
    /// that already lives in the target namespace).
    ///
    /// # Errors
    /// [`LibNftError::Load`] or [`LibNftError::Context`].
    pub fn here() -> Result<Self, LibNftError> {
        let api = api()?;
        let lib = lib_lock();
        // SAFETY: plain constructor call; NULL is checked below.
        let raw = unsafe { (api.ctx_new)(0) };
        if raw.is_null() {
            return Err(LibNftError::Context);
        }
        // SAFETY: `raw` is a live context.
        unsafe {
            (api.output_set_flags)(raw, NFT_CTX_OUTPUT_JSON);
            (api.buffer_output)(raw);
            (api.buffer_error)(raw);
        }
        drop(lib);
        let ctx = Ctx(raw);
        let nft = Self {
            ctx: Mutex::new(ctx),
        };
        // Open the netlink socket now, in this namespace (libnftables may open it lazily), with
        // a listing that needs no set elements: libnftables 1.0.6 fills its cache for `list
        // tables` with every element of every set (~75 ms with 20,000 elements), for `list
        // chains` with tables and chains only.
        nft.run(r#"{"nftables":[{"list":{"chains":null}}]}"#)?;
        Ok(nft)
    }

    /// A context whose socket lives in the named namespace.
    ///
    /// # Errors
    /// [`LibNftError::Netns`] when the namespace cannot be entered, or as [`LibNft::here`].
    pub fn in_netns(ns: &str) -> Result<Self, LibNftError> {
        crate::netns::run_in(ns, Self::here).map_err(LibNftError::Netns)?
    }

    /// Runs one nft command buffer (JSON, or nft syntax) as one transaction and returns nft's
    /// output (the JSON listing for `list` commands, empty otherwise).
    ///
    /// # Errors
    /// [`LibNftError::Refused`] with nft's message; nothing of the batch is applied then.
    pub fn run(&self, cmd: &str) -> Result<String, LibNftError> {
        let api = api()?;
        let c = CString::new(cmd).map_err(|_| LibNftError::Nul)?;
        let guard = self
            .ctx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _lib = lib_lock();
        // SAFETY: the context is live and used by this thread alone (mutex held); `c` is a valid
        // NUL-terminated string for the duration of the call.
        let status = unsafe { (api.run_cmd)(guard.0, c.as_ptr()) };
        // SAFETY: as above; the buffers belong to the context.
        let (out, err) = unsafe {
            (
                read((api.get_output)(guard.0)),
                read((api.get_error)(guard.0)),
            )
        };
        if status != 0 {
            return Err(LibNftError::Refused {
                status,
                message: err.trim().to_owned(),
            });
        }
        Ok(out)
    }
}
