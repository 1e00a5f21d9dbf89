"""The environment variables `jdist launch` gives each process of a job.

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
