"""Job staging written once: the output lock, `OUT.partial`, resume bookkeeping with a
verified fingerprint, atomic publish, the job's source model, and fault injection."""
from cmoe_jax.jobs.faults import FAULT_ENV, fault_point
from cmoe_jax.jobs.fingerprint import ResumeMismatchError, fingerprint
from cmoe_jax.jobs.job import OutputExistsError, OutputJob, check_output_free
from cmoe_jax.jobs.lock import OutputBusyError, OutputLock, lock_path
from cmoe_jax.jobs.progress import LayerLog, file_digest, write_bytes_atomic
from cmoe_jax.jobs.source import JobModel, MissingTokenizerError
from cmoe_jax.jobs.staging import OWNER, Staging, StagingError

__all__ = ["FAULT_ENV", "fault_point", "ResumeMismatchError", "fingerprint", "OutputExistsError",
           "OutputJob", "check_output_free", "OutputBusyError", "OutputLock", "lock_path", "LayerLog",
           "file_digest", "write_bytes_atomic", "JobModel", "MissingTokenizerError", "OWNER",
           "Staging", "StagingError"]
