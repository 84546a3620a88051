"""Hot index reload: a new version is served without a restart, the old one closed when its
last request ends; a bad version or one of another model is refused with the reason
while the old one serves on. The target runs `index.add` under load on a real server."""

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from index.build import build_index
from index.store import SIDECAR_FILE, current_version, load_index
from service.client import AsyncClient, Client, ServiceError
from service.galleries import GalleryHolder
from service.main import create_app
from service.retrieval import RetrievalEngine
from tests.conftest import REPO
from tests.fakes import FakeModel, make_gallery
from tests.service.conftest import service_process, sketch_png
from tests.service.test_metrics import samples


def test_a_retired_gallery_closes_when_its_last_lease_ends(fake_index):
    old, new = (load_index(fake_index[0]) for _ in range(2))
    holder = GalleryHolder(old, "v-old")
    with holder.lease() as leased:
        assert leased is old
        holder.swap(new, "v-new")
        assert holder.current() == (new, "v-new") and holder.open_versions == 2
        with holder.lease() as second:
            assert second is new  # requests that start after the swap see the new one
        assert leased.search(leased.index.reconstruct_n(0, 1), 1)[1][0, 0] == 0  # still open
    assert holder.open_versions == 1
    holder.swap(load_index(fake_index[0]), "v-newer")  # no lease: closed at once
    assert holder.open_versions == 1


@pytest.fixture
def own_index(tmp_path):
    """An index of its own (tests below write new versions) and its engine's app."""
    photos = make_gallery(tmp_path / "photos", classes=2, per_class=3)
    embedder = FakeModel(L=8)
    build_index(embedder, photos, tmp_path / "index", progress=False)
    return tmp_path, embedder


def app_of(settings, folder, embedder):
    from service.loading import open_current

    gallery, version = open_current(folder / "index", embedder)
    engine = RetrievalEngine(embedder, gallery, settings.max_pixels, version=version)
    return create_app(settings.model_copy(update={"index": folder / "index",
                                                  "reload_interval": 0}),
                      loader=lambda s: engine)


def test_admin_reload_serves_a_new_version_and_info_shows_it(own_index, settings):
    folder, embedder = own_index
    with TestClient(app_of(settings, folder, embedder)) as http:
        service = Client(http=http)
        before = service.info()
        assert before["index_version"] == current_version(folder / "index").name
        assert service.reload() == {"version": before["index_version"], "changed": False}
        make_gallery(folder / "photos", classes=3, per_class=3)  # a third class
        build_index(embedder, folder / "photos", folder / "index", progress=False)
        new = current_version(folder / "index").name
        assert service.reload() == {"version": new, "changed": True}
        info = service.info()
        assert (info["index_version"], info["gallery_size"], info["classes"]) == (new, 9, 3)
        assert "class2" in {h.cls for h in service.retrieve(sketch_png(), k=9).hits}
        got = samples(service.metrics())
        assert got[("sketchsvd_index_reloads_total", ())] == 1
        assert got[("sketchsvd_index_versions_open", ())] == 1


def test_a_version_of_another_model_is_refused_and_the_old_one_serves(own_index, settings,
                                                                          caplog):
    folder, embedder = own_index
    with TestClient(app_of(settings, folder, embedder)) as http:
        service = Client(http=http)
        served = service.info()["index_version"]
        other = FakeModel(L=8, seed=5)
        build_index(other, folder / "photos", folder / "index", progress=False)
        refused = current_version(folder / "index").name
        with caplog.at_level(logging.WARNING, logger="service.reload"):
            with pytest.raises(ServiceError) as err:
                service.reload()
        assert err.value.status == 409
        assert "was built with the model bundle of sha256" in err.value.detail
        assert f"still serving version {served}" in err.value.detail
        (line,) = [r.getMessage() for r in caplog.records if r.name == "service.reload"]
        assert line.startswith(f"refusing index version {refused}: IndexMismatchError")
        assert service.info()["index_version"] == served
        assert len(service.retrieve(sketch_png(), k=6).hits) == 6
        assert samples(service.metrics())[("sketchsvd_index_refusals_total", ())] == 1


def test_a_damaged_version_is_refused_naming_the_reason(own_index, settings, caplog):
    folder, embedder = own_index
    app = app_of(settings, folder, embedder)
    with TestClient(app) as http:
        served = app.state.engine.galleries.current()[1]
        build_index(embedder, folder / "photos", folder / "index", progress=False)
        version = current_version(folder / "index")
        side = json.loads((version / SIDECAR_FILE).read_text())
        (version / SIDECAR_FILE).write_text(json.dumps({**side, "count": 99}))
        with caplog.at_level(logging.WARNING, logger="service.reload"):
            outcome = app.state.reloader.check()
            again = app.state.reloader.check()  # not retried, not logged again
        assert outcome.served == served and "disagrees with itself" in outcome.refused
        assert again == outcome
        assert len([r for r in caplog.records if r.name == "service.reload"]) == 1
        assert http.get("/health").status_code == 200


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Load:
    """16 clients querying continuously (k above the gallery size: every photo returned);
    records failures and when photos of class `watch` first appear."""

    def __init__(self, url: str, sketches: list[bytes], watch: str):
        self.url, self.sketches, self.watch = url, sketches, watch
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.answered = 0
        self.first_seen: float | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self):
        async with AsyncClient(self.url, connections=16, timeout=60) as service:
            await asyncio.gather(*(self._client(service, i) for i in range(16)))

    async def _client(self, service, i: int):
        while not self.stop.is_set():
            try:
                result = await service.retrieve(self.sketches[i % len(self.sketches)], k=200)
            except Exception as err:  # noqa: BLE001 - every failure is the test's finding
                self.failures.append(repr(err))
                continue
            self.answered += 1
            if self.first_seen is None and any(h.cls == self.watch for h in result.hits):
                self.first_seen = time.monotonic()


def watch_pointer(path, changed: list[float], stop: threading.Event) -> None:
    first = path.read_text()
    while not stop.is_set() and not changed:
        if path.read_text() != first:
            changed.append(time.monotonic())
        time.sleep(0.005)


def test_index_add_under_load_is_served_within_2s_without_a_failed_request(
        tmp_path, real_bundle, small_gallery, small_sketches, sketchy_mini):
    photos, index = tmp_path / "photos", tmp_path / "index"
    shutil.copytree(small_gallery, photos)
    build_index(real_bundle, photos, index, progress=False)
    added = photos / "zz_added"  # below the photo root, as index.add requires
    added.mkdir()
    for f in sorted((sketchy_mini / "photo" / "zebra").iterdir())[:25]:
        for copy in range(4):  # 100 photos
            shutil.copyfile(f, added / f"{f.stem}_added{copy}{f.suffix}")
    with service_process(index, "--max-k", "200") as (url, proc):
        with Client(url) as service:
            assert service.info()["gallery_size"] == 15
        load = Load(url, small_sketches, "zz_added")
        changed, stop = [], threading.Event()
        watcher = threading.Thread(target=watch_pointer, args=(index / "CURRENT", changed, stop))
        load.thread.start()
        try:
            time.sleep(2)
            rss_before = rss_bytes(proc.pid)
            watcher.start()
            subprocess.run([sys.executable, "-m", "index.add", "--index", str(index),
                            "--photos", str(photos),
                            "--workers", "0", "--progress", "false", "--feature-cache", "none"],
                           cwd=REPO, check=True, capture_output=True, timeout=600)
            deadline = time.monotonic() + 30
            while load.first_seen is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1)
        finally:
            load.stop.set()
            stop.set()
            load.thread.join(timeout=120)
            if watcher.ident is not None:  # started
                watcher.join(timeout=10)
        with Client(url) as service:
            info, got = service.info(), samples(service.metrics())
        rss_after = rss_bytes(proc.pid)
    assert load.failures == [] and load.answered > 0
    assert changed and load.first_seen is not None
    delay = load.first_seen - changed[0]
    print(f"{load.answered} answered, none failed; new photos served {delay:.2f} s after the "
          f"pointer changed; RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert delay <= 2.0
    assert info["gallery_size"] == 115 and info["index_version"] == current_version(index).name
    assert got[("sketchsvd_index_versions_open", ())] == 1  # the old one closed
    assert abs(rss_after - rss_before) <= 50 * 2**20


def test_a_version_naming_another_photo_folder_is_refused_while_serving(own_index, settings):
    """The photo folder is fixed at start: a new version whose sidecar names another root
    (say "/", to serve the process's environment as a "photo") is refused, the old one
    keeps serving, and its files are never read from the other root."""
    folder, model = own_index
    with TestClient(app_of(settings, folder, model)) as http:
        service = Client(http=http)
        served = service.info()["index_version"]
        other = make_gallery(folder / "other", classes=2, per_class=3, seed=4)
        build_index(model, other, folder / "index", progress=False)  # root: other/
        with pytest.raises(ServiceError) as err:
            service.reload()
        assert err.value.status == 409 and "names the photo folder" in err.value.detail
        assert service.info()["index_version"] == served
        assert http.get("/photos/c0_0_000").status_code == 200  # from the first folder
