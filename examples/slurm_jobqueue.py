"""A SLURM cluster through dask-jobqueue: one batch job = one dask worker with one GPU.

The scheduler runs in this process (on the login / submit node); ``cluster.scale(jobs=K)``
submits K ``sbatch`` jobs, each starting one dask worker on a compute node. The data set and the
reconstruction store must be on a file system that the compute nodes see::

    python examples/slurm_jobqueue.py --print-job-script --partition gpu --account abc123
    python examples/slurm_jobqueue.py --data /shared/scan.zarr --output /shared/recon.zarr \\
        --jobs 4 --partition gpu --account abc123 --walltime 02:00:00 \\
        --prologue "source /shared/venvs/daskpty/bin/activate" --interface ib0

The scheduler preloads ``daskpty.monitor.dashboard``, so the dashboard's ``/daskpty`` page exists
from the start; the dashboard listens on 127.0.0.1 of the submit node (reach it with
``ssh -L 8787:127.0.0.1:8787 submit-node``). ``--tls`` encrypts and authenticates the
scheduler–worker traffic with throw-away certificates (needs the ``cryptography`` package).

Needs ``pip install dask-jobqueue`` and SLURM's ``sbatch``. Without dask-jobqueue, or (except for
``--print-job-script``) without ``sbatch``, it prints why and exits with status 0.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="data-set store on a shared file system")
    p.add_argument("--output", default=None, help="reconstruction store (also the checkpoint)")
    p.add_argument("--resume", action="store_true", help="continue from --output if it exists")
    p.add_argument("--jobs", type=int, default=2, help="batch jobs = GPU workers (default 2)")
    p.add_argument("--partition", default=None, help="SLURM partition (sbatch -p)")
    p.add_argument("--account", default=None, help="SLURM account (sbatch -A)")
    p.add_argument("--walltime", default="01:00:00", help="per job (default 01:00:00)")
    p.add_argument("--cores", type=int, default=4, help="CPU cores per job = worker threads (default 4)")
    p.add_argument("--memory", default="64GB", help="host memory per job (default 64GB)")
    p.add_argument("--gpus-per-job", type=int, default=1, help="GPUs per job, 0 for CPU workers (default 1)")
    p.add_argument("--interface", default=None, help="network interface of the nodes, e.g. ib0")
    p.add_argument("--prologue", action="append", default=[],
                   help="shell line run before the worker starts (repeatable), e.g. activating a venv")
    p.add_argument("--tls", action="store_true", help="TLS with temporary certificates")
    p.add_argument("--epochs", type=int, default=100, help="LSQML epochs (default 100)")
    p.add_argument("--rounds-per-epoch", type=int, default=1, help="updates per epoch (default 1)")
    p.add_argument("--print-job-script", action="store_true",
                   help="print the batch script a worker job would run, submit nothing, and exit")
    return p.parse_args(argv)


def make_cluster(args, dashboard_port: int = 8787):
    from dask_jobqueue import SLURMCluster

    directives = [f"--gres=gpu:{args.gpus_per_job}"] if args.gpus_per_job else []
    return SLURMCluster(
        queue=args.partition, account=args.account, walltime=args.walltime,
        cores=args.cores, processes=1, memory=args.memory,     # one worker process per job
        job_extra_directives=directives, job_script_prologue=args.prologue,
        interface=args.interface,
        scheduler_options={"preload": ["daskpty.monitor.dashboard"],
                           "dashboard_address": f"127.0.0.1:{dashboard_port}"},
        security=True if args.tls else None,
        shared_temp_directory=os.path.expanduser("~/.daskpty-certs") if args.tls else None,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import dask_jobqueue  # noqa: F401
    except ImportError:
        print("slurm_jobqueue: dask-jobqueue is not installed (pip install dask-jobqueue); "
              "nothing to submit.")
        return 0
    if args.tls:
        os.makedirs(os.path.expanduser("~/.daskpty-certs"), mode=0o700, exist_ok=True)
    if args.print_job_script:
        with make_cluster(args, dashboard_port=0) as cluster:
            print(cluster.job_script())
        return 0
    if shutil.which("sbatch") is None:
        print("slurm_jobqueue: no SLURM here (sbatch is not on PATH); run this on a SLURM submit "
              "node, or use --print-job-script to see what would be submitted.")
        return 0
    if not args.data:
        print("slurm_jobqueue: give the data set with --data /shared/path/scan.zarr", file=sys.stderr)
        return 2

    import daskpty
    from distributed import Client

    with make_cluster(args) as cluster, Client(cluster) as client:
        cluster.scale(jobs=args.jobs)
        print(f"submitted {args.jobs} job(s); waiting for the workers "
              f"(dashboard {client.dashboard_link}) ...", flush=True)
        client.wait_for_workers(args.jobs)
        data = daskpty.open_data(args.data)
        resume = args.output if args.resume and args.output and os.path.exists(args.output) else None
        rec = daskpty.reconstruct(data, epochs=args.epochs, rounds_per_epoch=args.rounds_per_epoch,
                                  noise="poisson", client=client, checkpoint=args.output,
                                  resume=resume, dashboard=True, progress=True)
    print(f"done: {rec.epochs} epochs, object {rec.object.shape}"
          + (f", written to {args.output}" if args.output else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
