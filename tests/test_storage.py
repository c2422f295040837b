"""Both storage backends against the same expectations: LocalStorage and S3Storage on real SeaweedFS."""

from __future__ import annotations

import pytest

from voxbatch import testing_services as services
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage, S3Storage, StorageError, open_storage


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    seaweed = request.getfixturevalue("seaweed")
    settings = Settings(s3_endpoint=seaweed.endpoint, aws_access_key_id=services.S3_KEY,
                        aws_secret_access_key=services.S3_SECRET)
    return S3Storage(f"s3://{seaweed.new_bucket()}/some/prefix", settings)


def test_put_get_list_delete(storage, tmp_path):
    storage.put("jobs/a/segments/0000/0000-00001.wav", b"one")
    storage.put("jobs/a/segments/0000/0000-00000.wav", b"zero")
    storage.put("jobs/b/job.json", b"{}")
    assert storage.get("jobs/a/segments/0000/0000-00000.wav") == b"zero"
    assert storage.list("jobs/a/") == ["jobs/a/segments/0000/0000-00000.wav", "jobs/a/segments/0000/0000-00001.wav"]
    assert storage.exists("jobs/b/job.json") and not storage.exists("jobs/b/nothing")
    storage.put("jobs/b/job.json", b'{"v": 2}')  # overwrite is whole
    assert storage.get("jobs/b/job.json") == b'{"v": 2}'
    storage.get_file("jobs/a/segments/0000/0000-00001.wav", tmp_path / "dl" / "x.wav")
    assert (tmp_path / "dl" / "x.wav").read_bytes() == b"one"
    assert [p.name for p in (tmp_path / "dl").iterdir()] == ["x.wav"]  # no .part left behind
    storage.delete("jobs/b/job.json")
    assert not storage.exists("jobs/b/job.json")
    with pytest.raises(KeyError):
        storage.get("jobs/b/job.json")
    with pytest.raises(KeyError):
        storage.get_file("jobs/b/job.json", tmp_path / "dl" / "missing")
    assert not (tmp_path / "dl" / "missing").exists()


def test_local_write_is_atomic_when_it_fails(tmp_path, monkeypatch):
    """A write that dies after some bytes hit the disk leaves the old object and no partial file."""
    store = LocalStorage(tmp_path)
    store.put("k.bin", b"old")

    def disk_gone(_fd):
        raise OSError("disk gone")

    monkeypatch.setattr("voxbatch.storage.os.fsync", disk_gone)
    with pytest.raises(OSError, match="disk gone"):
        store.put("k.bin", b"new and longer")
    assert store.get("k.bin") == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["k.bin"]


def test_local_refuses_keys_outside_its_root(tmp_path):
    store = LocalStorage(tmp_path / "root")
    # Up and out, absolute, the root itself, and a sibling whose name begins with the root's.
    for key in ("../escape", "a/../../escape", "/etc/passwd", ".", "", "a/..", "../root2/x", "../root/../root2/x"):
        with pytest.raises(StorageError, match="escapes the storage root"):
            store.put(key, b"x")
    assert not (tmp_path / "root2").exists() and not (tmp_path / "escape").exists()
    store.put("a/../b//c.bin", b"x")  # what normalises to a key inside the root is that key
    assert store.get("b/c.bin") == b"x"


def test_existing_names_exactly_the_stored_keys_asked_for(storage):
    """`existing` (a worker's one question per task): the stored ones among the keys asked, in one
    chapter or across two, never a stored neighbour it was not asked about; and what S3 answers
    with a listing is what a HEAD per key answers."""
    seg = "jobs/a/segments/{0:04d}/{0:04d}-{1:05d}.wav".format
    for key in (seg(0, 7), seg(0, 9), seg(0, 10), seg(0, 30), seg(1, 0), seg(1, 2), "jobs/a/segments/0000/0000-00009.wav.x",
                "jobs/ab/segments/0000/0000-00009.wav"):
        storage.put(key, b"x")
    one_chapter = [seg(0, i) for i in range(8, 24)]  # a task of 16: 8..23
    assert storage.existing(one_chapter) == {seg(0, 9), seg(0, 10)}
    across = [seg(0, i) for i in range(28, 32)] + [seg(1, i) for i in range(0, 4)]
    assert storage.existing(across) == {seg(0, 30), seg(1, 0), seg(1, 2)}
    for keys in (one_chapter, across, [seg(0, 7)], [], [seg(0, 9), "jobs/b/other.json"]):
        assert storage.existing(keys) == {k for k in keys if storage.exists(k)}


def test_open_storage_by_url(tmp_path):
    settings = Settings(storage_url=(tmp_path / "s").as_uri())
    assert isinstance(open_storage(settings), LocalStorage)
    with pytest.raises(ValueError):
        Settings(storage_url="ftp://nope")


def test_s3_errors_never_show_the_secret(seaweed):
    settings = Settings(s3_endpoint=seaweed.endpoint, aws_access_key_id=services.S3_KEY,
                        aws_secret_access_key="wrong-" + services.S3_SECRET)
    store = S3Storage(f"s3://{seaweed.new_bucket()}/p", settings)
    with pytest.raises(Exception) as info:
        store.put("k", b"x")
    assert services.S3_SECRET not in str(info.value) and "wrong-" not in str(info.value)
    assert services.S3_SECRET not in repr(settings)


def test_broker_password_is_not_in_settings_repr():
    """The broker URL can carry the Redis password (compose and k8s pass one): repr/str of the
    settings, which end up in logs and tracebacks, must not show it."""
    settings = Settings(broker_url="redis://:s3cr3t-pw@redis:6379/0")
    assert settings.broker_url.endswith("@redis:6379/0")
    assert "s3cr3t-pw" not in repr(settings) and "s3cr3t-pw" not in str(settings)
