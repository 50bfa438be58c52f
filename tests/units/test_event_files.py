"""The TensorBoard logger: one event per step's scalars, text, and a resumed run's purge of later points."""
from grpo_accel.reporting.event_files import TensorBoardLogger, read_scalars, read_texts


def events(log_dir):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e for f in sorted(log_dir.iterdir()) for e in EventFileLoader(str(f)).Load() if e.HasField("summary")]


def test_a_steps_scalars_are_one_event_that_tensorboard_reads(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    for step in range(3):
        logger.log_scalars({"train/a": step, "train/b": 2.0 * step, "time/c": 0.5}, step)
    logger.log_scalar("eval/x", 7.0, 2)
    logger.log_text("samples", "**reward 1**", 2)
    logger.close()
    written = events(tmp_path)
    assert [len(e.summary.value) for e in written] == [3, 3, 3, 1, 1]
    scalars = read_scalars(tmp_path)
    assert scalars["train/b"] == [(0, 0.0), (1, 2.0), (2, 4.0)] and scalars["eval/x"] == [(2, 7.0)]
    assert read_texts(tmp_path) == {"samples": [(2, "**reward 1**")]}


def test_resume_drops_what_the_interrupted_run_logged_after_the_checkpoint(tmp_path):
    first = TensorBoardLogger(tmp_path)
    for step in range(1, 6):  # logged up to step 5, checkpoint at step 3
        first.log_scalars({"train/loss": float(step)}, step)
    first.close()
    resumed = TensorBoardLogger(tmp_path)
    resumed.resume_at(3)
    for step in (4, 5):
        resumed.log_scalars({"train/loss": 10.0 * step}, step)
    resumed.close()
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
