"""Job staging written once: the output lock, `OUT.partial`, resume bookkeeping with a
verified fingerprint, atomic publish, outputs kept apart from inputs and inputs watched for
change, the job's source model, the fault hook (`cmoe_jax.faults`), and the one skeleton
every job runs (`run_job`; a registered method through `run_method`)."""
from cmoe_jax.faults import FAULT_ENV, fault_point
from cmoe_jax.jobs.fingerprint import ResumeMismatchError, fingerprint
from cmoe_jax.jobs.fingerprint import content_digest as file_digest  # a file's digest, as exports name it
from cmoe_jax.jobs.output import OutputExistsError, OutputDir, check_output_free
from cmoe_jax.jobs.lock import OutputBusyError, OutputLock, lock_path
from cmoe_jax.jobs.progress import LayerLog
from cmoe_jax.jobs.source import SourceModel, MissingTokenizerError
from cmoe_jax.jobs.staging import OWNER, Staging, StagingError
from cmoe_jax.jobs.skeleton import Interrupted, Job, JobRun, Outcome, RunOptions, run_job
from cmoe_jax.jobs.method_job import MethodJob, run_method

__all__ = ["FAULT_ENV", "fault_point", "ResumeMismatchError", "fingerprint", "OutputExistsError",
           "OutputDir", "check_output_free", "OutputBusyError", "OutputLock", "lock_path", "LayerLog",
           "file_digest", "SourceModel", "MissingTokenizerError", "OWNER",
           "Staging", "StagingError", "Interrupted", "Job", "JobRun", "Outcome", "RunOptions", "run_job",
           "MethodJob", "run_method"]
