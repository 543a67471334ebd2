"""Scale-out: parameter sweeps over a notebook and batches of render jobs, spread over Dask workers.

    lab sweep 01 -p batch_size 8,16,32                       # one papermill run per point, one worker per GPU
    lab render musetalk --preset exact --jobs jobs.csv       # each worker keeps its built engine across jobs

`cluster` opens the pool the work runs on (a local cluster of processes on a CPU, one worker per GPU on a
GPU host, or the workers of an existing scheduler; `workers=1` runs in this process without Dask),
`sweep` plans, runs, resumes and tabulates a sweep, `jobs` runs a jobs file on kept engines.
"""
