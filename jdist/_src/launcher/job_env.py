"""The environment `jdist launch` gives each process of a job.

Where the coordinator is, how many processes the job has, which one this is
and which of the host's devices it uses, which attempt of the job runs, and
where the process reports its health: the launcher writes these variables
(`ranks.py`); the runtime (`runtime/cluster.py`, `runtime/health_report.py`)
and the checkpoints (a job's run id and attempt) read them.

Example:
  >>> from jdist._src.launcher import job_env
  >>> job_env.ENV_NUM_PROCESSES
  'JDIST_NUM_PROCESSES'
"""

ENV_COORDINATOR = "JDIST_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JDIST_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JDIST_LOCAL_DEVICE_IDS"
ENV_RESTART_COUNT = "JDIST_RESTART_COUNT"
ENV_MAX_RESTARTS = "JDIST_MAX_RESTARTS"
ENV_RUN_ID = "JDIST_RUN_ID"  # the same in every attempt of a job
ENV_HEALTH_FILE = "JDIST_HEALTH_FILE"
