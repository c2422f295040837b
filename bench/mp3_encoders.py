"""Which MP3 encoder voxbatch uses: speed and CBR exactness of the three maintained candidates.

Candidates (all LAME underneath, wrapped differently):

  soundfile   libsndfile's MPEG writer (`format="MP3"`, `bitrate_mode="CONSTANT"`)
  lameenc     the lameenc binding (`set_bit_rate`, `set_vbr` off)
  pedalboard  pedalboard.io.AudioFile.encode(..., quality=192)

For each: encode the same 60 s of 44.1 kHz mono (a tone-engine-like signal: tones and pauses, plus
white noise at -70 dBFS) at 192 kb/s, best of 3 wall times; then, measured outside the encoder:
ffprobe's stream bit rate and sample rate, every packet's size (a 192 kb/s CBR frame at 44.1 kHz is
626 or 627 bytes: 144 * 192000 / 44100 plus a padding byte), and the decoded length against the input
(gapless info: an encoder that writes the LAME tag decodes to exactly the samples given).

Usage (repo root): python -m bench.mp3_encoders [--seconds 60] [--out bench/results/mp3_encoders.json]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

RATE = 44100
KBPS = 192
CBR_FRAME_BYTES = {144 * KBPS * 1000 // RATE, 144 * KBPS * 1000 // RATE + 1}


def signal(seconds: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * RATE)) / RATE
    x = 0.3 * np.sin(2 * np.pi * 220 * t) * (np.sin(2 * np.pi * 0.5 * t) > -0.3)  # tones with pauses
    return (x + 10 ** (-70 / 20) * rng.standard_normal(len(t))).astype(np.float32)


def enc_soundfile(x: np.ndarray) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    # libsndfile maps compression_level 0..1 onto LAME's bit rates: for CONSTANT it picks the bit rate
    # from that level; 192 kb/s is not reachable exactly at every level, so the level is searched.
    sf.write(buf, x, RATE, format="MP3", subtype="MPEG_LAYER_III", bitrate_mode="CONSTANT",
             compression_level=_SF_LEVEL)
    return buf.getvalue()


_SF_LEVEL = 0.0  # set by main() to the level that gives 192 kb/s


def enc_lameenc(x: np.ndarray) -> bytes:
    import lameenc

    e = lameenc.Encoder()
    e.set_bit_rate(KBPS)
    e.set_in_sample_rate(RATE)
    e.set_channels(1)
    e.set_quality(2)
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    return bytes(e.encode(pcm) + e.flush())


def enc_pedalboard(x: np.ndarray) -> bytes:
    from pedalboard.io import AudioFile

    return bytes(AudioFile.encode(x[None, :], RATE, "mp3", 1, quality=KBPS))


ENCODERS = {"soundfile": enc_soundfile, "lameenc": enc_lameenc, "pedalboard": enc_pedalboard}


def ffprobe(path: Path) -> dict:
    out = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "a:0", "-show_entries",
                          "stream=bit_rate,sample_rate,channels:packet=size", "-of", "json", str(path)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def decoded_len(path: Path) -> int:
    pcm = subprocess.run(["ffmpeg", "-v", "error", "-i", str(path), "-f", "f32le", "-ac", "1", "-"],
                         capture_output=True, check=True).stdout
    return len(pcm) // 4


def measure(name: str, x: np.ndarray, tmp: Path) -> dict:
    fn = ENCODERS[name]
    try:
        data = fn(x)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot encode is a result, not a crash
        return {"encoder": name, "error": f"{type(e).__name__}: {e}"}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    path = tmp / f"{name}.mp3"
    path.write_bytes(data)
    probe = ffprobe(path)
    sizes = [int(p["size"]) for p in probe["packets"]]
    off = [s for s in sizes if s not in CBR_FRAME_BYTES]
    stream = probe["streams"][0]
    return {
        "encoder": name,
        "encode_s": round(min(times), 4),
        "x_realtime": round(len(x) / RATE / min(times), 1),
        "bytes": len(data),
        "ffprobe_bit_rate": int(stream["bit_rate"]),
        "ffprobe_sample_rate": int(stream["sample_rate"]),
        "channels": int(stream["channels"]),
        "packets": len(sizes),
        "packets_not_cbr_192k": len(off),
        "cbr_exact": not off,
        "decoded_samples": decoded_len(path),
        "input_samples": len(x),
    }


def main() -> None:
    global _SF_LEVEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--out", default="bench/results/mp3_encoders.json")
    args = ap.parse_args()
    x = signal(args.seconds)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # libsndfile's level -> bit rate mapping: find a level giving 192 kb/s (if any).
        for level in np.linspace(0, 1, 21):
            _SF_LEVEL = float(level)
            p = tmp / "probe.mp3"
            p.write_bytes(enc_soundfile(x[: RATE * 5]))
            if int(ffprobe(p)["streams"][0]["bit_rate"]) // 1000 == KBPS:
                break
        for name in ENCODERS:
            row = measure(name, x, tmp)
            if name == "soundfile":
                row["compression_level"] = _SF_LEVEL
            rows.append(row)
            print(json.dumps(row))
    result = {"what": "MP3 encoders at 192 kb/s CBR, 44.1 kHz mono", "seconds": args.seconds,
              "machine": platform.processor() or platform.machine(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
