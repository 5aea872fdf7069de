//! `HostOptions::from_env` takes the selector from the environment and `HostOptions::default` reads none of it.
//! One test in its own binary, since it changes this process's environment.

use std::time::Duration;

use anyccl_core::{Algorithm, DataType, Error, InOut, ReduceOp};
use anyccl_host::{communicators, HostBuffer, HostOptions, HostStream};

/// The algorithm a two-rank all-reduce of 256 floats runs under `opts`.
fn algorithm_run(opts: HostOptions) -> Algorithm {
    let opts = HostOptions { timeout: Duration::from_secs(60), ..opts };
    let comms = communicators(2, opts).expect("host group");
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let mut buf = HostBuffer::from_elems(&[1.0f32; 256]);
                    let chosen = comm
                        .all_reduce(InOut::InPlace(buf.as_bytes_mut()), 256, DataType::F32, ReduceOp::Sum, &HostStream)
                        .expect("all-reduce");
                    assert_eq!(buf.to_vec::<f32>(), [2.0; 256]);
                    chosen.algorithm
                })
            })
            .collect();
        let run: Vec<Algorithm> = ranks.into_iter().map(|h| h.join().expect("rank thread")).collect();
        assert_eq!(run[0], run[1]);
        run[0]
    })
}

fn config_error_names(r: anyccl_core::Result<HostOptions>, var: &str) {
    match r {
        Err(Error::Config { source_name, .. }) => assert_eq!(source_name, var),
        other => panic!("{var}: expected Error::Config naming it, got {other:?}"),
    }
}

#[test]
fn from_env_reads_the_selector_variables_and_default_does_not() {
    for var in ["ANYCCL_ALLREDUCE_ALGO", "ANYCCL_TUNE_FILE", "ANYCCL_DETERMINISTIC", "ANYCCL_FUSED_RMSNORM"] {
        std::env::remove_var(var);
    }
    let plain = HostOptions::from_env().expect("nothing set");
    assert_eq!(plain.selector.forced(), None);
    assert!(!plain.selector.deterministic());
    // The defaults choose one-shot for a small message; forcing ring shows which options read the variable.
    assert_ne!(algorithm_run(HostOptions::default()), Algorithm::Ring);

    std::env::set_var("ANYCCL_ALLREDUCE_ALGO", "ring");
    std::env::set_var("ANYCCL_DETERMINISTIC", "1");
    let defaults = HostOptions::default();
    assert_eq!(defaults.selector.forced(), None);
    assert!(!defaults.selector.deterministic());
    assert_ne!(algorithm_run(defaults), Algorithm::Ring);
    std::env::remove_var("ANYCCL_DETERMINISTIC");
    let from_env = HostOptions::from_env().expect("valid values");
    assert_eq!(from_env.selector.forced(), Some(Algorithm::Ring));
    assert_eq!(from_env.timeout, HostOptions::default().timeout);
    assert_eq!(algorithm_run(from_env), Algorithm::Ring);

    std::env::set_var("ANYCCL_DETERMINISTIC", "1");
    std::env::set_var("ANYCCL_ALLREDUCE_ALGO", "two-shot");
    let deterministic = HostOptions::from_env().expect("valid values");
    assert!(deterministic.selector.deterministic());
    assert_eq!(algorithm_run(deterministic), Algorithm::TwoShot);

    std::env::set_var("ANYCCL_DETERMINISTIC", "sometimes");
    config_error_names(HostOptions::from_env(), "ANYCCL_DETERMINISTIC");
    std::env::remove_var("ANYCCL_DETERMINISTIC");
    std::env::set_var("ANYCCL_ALLREDUCE_ALGO", "fastest");
    config_error_names(HostOptions::from_env(), "ANYCCL_ALLREDUCE_ALGO");
    std::env::remove_var("ANYCCL_ALLREDUCE_ALGO");
}
