"""The environment `jdist launch` gives each process of a job.

Where the coordinator is, how many processes the job has, which one this is
and which of the host's devices it uses: the launcher writes these variables
(`ranks.py`) and `EnvironmentClusterResolver` (`cluster.py`) reads them. A
module of its own, without JAX, so that the launcher never loads JAX.

Example:
  >>> from jdist._src.multiprocess import job_env
  >>> job_env.ENV_NUM_PROCESSES
  'JDIST_NUM_PROCESSES'
"""

ENV_COORDINATOR = "JDIST_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JDIST_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JDIST_LOCAL_DEVICE_IDS"
