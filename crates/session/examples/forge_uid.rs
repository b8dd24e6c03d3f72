//! Test tool for tests/test_auth.py, not part of the product: launches a
//! command with a spec that claims uid 0, gid 0 and group 0 — what a hostile
//! client could send — on the embedded cluster of `STARLING_INSTANCE`
//! (through the same discovery as `starling exec`), and prints what the task
//! prints and its exit code. A head that names its local clients by their
//! kernel credentials runs the task as the caller anyway.
//!
//! Usage: `forge_uid CMD [ARGS...]`

use starling_config::{Chunking, ClusterState, Instance};
use starling_session::discover::Target;
use starling_session::{Session, SessionOptions, TaskEvent};

fn main() {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let instance = Instance::parse(&std::env::var("STARLING_INSTANCE").unwrap_or_default()).expect("STARLING_INSTANCE");
    let record = ClusterState::read(&instance.cluster_file()).expect("reading the cluster record").expect("no cluster is up");
    let target = Target::embedded(record);
    let mut spec = starling_session::spec::capture(argv).expect("capturing the spec");
    spec.uid = 0;
    spec.gid = 0;
    spec.groups = vec![0];
    let cache = std::env::temp_dir().join(format!("forge-uid-{}", std::process::id()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let code = rt.block_on(async {
        let opts = SessionOptions { compress: false, cache_dir: cache.clone(), chunking: Chunking::ContentDefined };
        let session = Session::connect(&target, opts).await.expect("connecting");
        let mut task = match session.launch(spec).await {
            Ok(t) => t,
            Err(e) => {
                println!("REFUSED {e}");
                return 3;
            }
        };
        while let Some(ev) = task.events.recv().await {
            match ev {
                TaskEvent::Output(_, data) => print!("{}", String::from_utf8_lossy(&data)),
                TaskEvent::Finished { status, .. } => return status.shell_code(),
                TaskEvent::Lost(why) | TaskEvent::Refused(why) => {
                    println!("LOST {why}");
                    return 4;
                }
                _ => {}
            }
        }
        4
    });
    let _ = std::fs::remove_dir_all(&cache);
    std::process::exit(code);
}
