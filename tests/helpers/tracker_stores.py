"""The trackers' local stores, for tests: the environment that keeps W&B offline, MLflow in a SQLite file and
Trackio in a folder, and W&B's run file read back record by record."""
import os
import struct
from pathlib import Path


WITHOUT_MLFLOW = str(Path(__file__).parent / "without_mlflow")
"""On the PYTHONPATH of every process the tests start (tests/conftest.py): MLflow hidden there."""


def tracker_env(root: Path) -> dict:
    """The stores' environment, with MLflow importable again (WITHOUT_MLFLOW off the PYTHONPATH)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != WITHOUT_MLFLOW]
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
            "TRACKIO_DIR": str(root / "trackio"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(path)}


def wandb_records(path: Path):
    """The records of a W&B run file (run-<id>.wandb): a 7-byte header (":W&B", magic, version), then LevelDB's
    log format (32 KiB blocks of chunks: CRC32C, length, type FULL/FIRST/MIDDLE/LAST) holding W&B's own
    ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
            pending = b""
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records
