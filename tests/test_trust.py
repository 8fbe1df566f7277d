"""The trust model of a shared spool (docs/design.md, "Security"), tried
with real users as a hostile member of the group would: ``owner`` owns the
spool and runs its workers, ``web`` is a trusted member, ``evil`` an
untrusted member and ``out`` is not in the group."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from conftest import ROOT, watching

MODES = {"": 0o2750, "tmp": 0o2750, "new": 0o2750, "cur": 0o2750, "failed": 0o2750, "dead": 0o2750,
         "done": 0o2750, "drop": 0o3730, "workers": 0o700}


def _drop_as(users, user, spool: Path, name: str, job: dict, umask: str = "027"):
    """The README's shell drop for a member of a shared spool, as ``user``
    under ``umask``: written under a dot-name in drop/, then renamed."""
    return users.sh(user, 'printf "%s\\n" "$2" > "$1/drop/.$3" && mv "$1/drop/.$3" "$1/drop/$3.json"',
                    str(spool), json.dumps(job), name, umask=umask)


def _owners_drop(users, user, spool: Path, name: str, job: dict, umask: str = "027"):
    """The README's shell drop of a spool's own user: tmp/, then new/."""
    return users.sh(user, 'printf "%s\\n" "$2" > "$1/tmp/$3" && mv "$1/tmp/$3" "$1/new/$3.json"',
                    str(spool), json.dumps(job), name, umask=umask)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _one_line_error(run) -> str:
    assert run.returncode != 0 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    return run.stderr


def test_a_shared_spool_has_the_documented_modes_and_a_member_enqueues_and_reads(users):
    spool = users.shared_spool()
    gid = users.gid
    for folder, mode in MODES.items():
        st = os.stat(spool / folder)
        assert (stat.S_IMODE(st.st_mode), st.st_gid, st.st_uid) == (mode, gid, users.owner.uid), folder
    assert _mode(spool / "config.json") == 0o640
    out = users.folder("out", owner=users.web)
    os.chmod(out, 0o777)
    # However careless its umask, spoolq and spoolq-drop write files only their owner may write.
    ids = []
    for umask in ("000", "002", "077"):
        run = users.spoolq(users.web, "-s", str(spool), "enqueue", f"echo {umask} >> {out}/ran", umask=umask)
        assert run.returncode == 0, run.stderr
        ids.append(run.stdout.strip())
    drop = users.folder("bin") / "spoolq-drop"
    shutil.copy(ROOT / "contrib" / "spoolq-drop", drop)
    os.chmod(drop, 0o755)
    run = users.sh(users.web, f"{drop} -s {spool} 'echo drop >> {out}/ran'", umask="002")
    assert run.returncode == 0, run.stderr
    ids.append(run.stdout.strip())
    assert _drop_as(users, users.web, spool, "shell", {"command": f"echo shell >> {out}/ran"}).returncode == 0
    ids.append("shell")
    for job_id in ids:
        # In drop/, readable by the group (the owner's side reads it through it), written by its member alone.
        st = os.stat(spool / "drop" / f"{job_id}.json")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, users.web.uid, gid), job_id
    # The owner sees them waiting; the member sees its own job waiting ...
    assert "dropped          5" in users.spoolq(users.owner, "-s", str(spool), "status").stdout
    assert "state: dropped" in users.spoolq(users.web, "-s", str(spool), "show", ids[0]).stdout
    # ... but runs no worker, compaction or settings change.
    for args in (["work"], ["sweep"], ["compact"], ["purge", "--dead", "--older-than", "1d"],
                 ["config", "set", "trusted_users", users.evil.name]):
        error = _one_line_error(users.spoolq(users.web, "-s", str(spool), *args))
        root = "" if args[0] in ("work", "sweep") else " or root"  # (root runs workers only on root's spools)
        assert f"only {users.owner.name}, who owns {spool},{root} may" in error, args
    run = users.spoolq(users.owner, "-s", str(spool), "work")
    assert run.returncode == 0, run.stderr
    assert sorted((out / "ran").read_text().split()) == ["000", "002", "077", "drop", "shell"]
    for job_id in ids:
        st = os.stat(spool / "done" / f"{job_id}.json")
        # The record the owner's side wrote: the owner's alone, and no member may open it.
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, users.owner.uid), job_id
    assert os.listdir(spool / "drop") == []
    # The member lists its jobs, and is told whose the records are.
    listed = users.spoolq(users.web, "-s", str(spool), "list").stdout
    assert listed.count("done") == 5 and listed.count("[record readable by the spool's owner only]") == 5, listed
    run = users.spoolq(users.web, "-s", str(spool), "show", ids[0])
    assert run.returncode == 0 and "readable by sqtowner, the spool's owner, only" in run.stdout, run.stdout
    assert "invalid" not in run.stdout and "unreadable" not in run.stdout
    assert users.spoolq(users.owner, "-s", str(spool), "compact").returncode == 0
    for name in ("index.db", "index.db-wal", "index.db-shm"):
        if (spool / name).exists():
            assert _mode(spool / name) == 0o640 and os.stat(spool / name).st_uid == users.owner.uid, name
    run = users.spoolq(users.web, "-s", str(spool), "show", ids[0])
    assert run.returncode == 0 and "outcome: succeeded" in run.stdout, run.stderr
    # Someone outside the group cannot even look.
    assert users.spoolq(users.out, "-s", str(spool), "list").returncode != 0


def test_a_member_cannot_rewrite_the_settings_to_trust_itself(users):
    spool = users.shared_spool()
    out = users.folder("out", owner=users.evil)
    forged = json.dumps({"trusted_users": [users.evil.name], "fsync": False})
    attempts = [
        f"printf '%s' '{forged}' > {spool}/config.json",
        f"printf '%s' '{forged}' > {spool}/forged && mv -f {spool}/forged {spool}/config.json",
        f"rm -f {spool}/config.json",
        f"ln -s {out}/mine.json {spool}/index.db",
    ]
    for attempt in attempts:
        assert users.sh(users.evil, attempt).returncode != 0, attempt
    assert _drop_as(users, users.evil, spool, "evil", {"command": f"touch {out}/pwned"}).returncode == 0
    assert users.spoolq(users.owner, "-s", str(spool), "work").returncode == 0
    assert not (out / "pwned").exists()
    show = users.spoolq(users.owner, "-s", str(spool), "show", "evil").stdout
    assert "untrusted user sqtevil" in show


def test_settings_or_an_index_that_another_user_could_have_written_are_refused(users):
    spool = users.shared_spool()
    # A config.json the member got in somehow (made by root for it here):
    # the worker refuses to run with it, and says what to do.
    config = spool / "config.json"
    config.write_text(json.dumps({"trusted_users": [users.evil.name]}))
    os.chown(config, users.evil.uid, users.gid)
    error = _one_line_error(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert f"{config} belongs to sqtevil, not to the spool's owner sqtowner" in error
    os.chown(config, users.owner.uid, users.gid)
    os.chmod(config, 0o660)
    error = _one_line_error(users.spoolq(users.owner, "-s", str(spool), "status"))
    assert f"{config} is writable by its group (mode 660)" in error and "chmod go-w" in error
    os.chmod(config, 0o640)
    assert users.spoolq(users.owner, "-s", str(spool), "status").returncode == 0
    # The same for the index.
    assert users.spoolq(users.owner, "-s", str(spool), "enqueue", "true").returncode == 0
    assert users.spoolq(users.owner, "-s", str(spool), "work").returncode == 0
    assert users.spoolq(users.owner, "-s", str(spool), "compact").returncode == 0
    os.chown(spool / "index.db", users.evil.uid, users.gid)
    for args in (["stats"], ["show", "--json", "x"]):
        error = _one_line_error(users.spoolq(users.owner, "-s", str(spool), *args))
        assert "index.db belongs to sqtevil" in error, args


def test_a_member_cannot_change_or_replace_a_trusted_members_job(users):
    spool = users.shared_spool()
    out = users.folder("out", owner=users.evil)
    os.chmod(out, 0o777)
    assert _drop_as(users, users.web, spool, "careful", {"command": f"echo web > {out}/careful"}).returncode == 0
    evil_job = json.dumps({"command": f"id -un > {out}/careful"})
    attempts = [
        f"printf '%s' '{evil_job}' > {spool}/drop/careful.json",
        f"printf '%s' '{evil_job}' > {spool}/drop/.x && mv -f {spool}/drop/.x {spool}/drop/careful.json",
        f"mv {spool}/drop/careful.json {spool}/drop/.stolen",
        f"rm -f {spool}/drop/careful.json",
        f"printf '%s' '{evil_job}' > {spool}/new/careful.json",
        f"printf '%s' '{evil_job}' > {spool}/tmp/x",
    ]
    for attempt in attempts:
        assert users.sh(users.evil, attempt).returncode != 0, attempt
    # A file its writer left group-writable could have been changed by any
    # member: it does not run.
    run = _drop_as(users, users.web, spool, "careless", {"command": f"echo web > {out}/careless"}, umask="002")
    assert run.returncode == 0 and _mode(spool / "drop" / "careless.json") == 0o664
    assert users.sh(users.evil, f"printf '%s' '{json.dumps({'command': f'id -un > {out}/careless'})}' "
                                f"> {spool}/drop/careless.json").returncode == 0
    assert users.spoolq(users.owner, "-s", str(spool), "work").returncode == 0
    assert (out / "careful").read_text() == "web\n"
    assert not (out / "careless").exists()
    show = users.spoolq(users.owner, "-s", str(spool), "show", "careless").stdout
    assert "writable by the spool's group (mode 664)" in show and "umask 027" in show


def test_a_member_cannot_rename_a_record_back_into_new(users):
    spool = users.shared_spool()
    out = users.folder("out", owner=users.web)
    os.chmod(out, 0o777)
    job = users.spoolq(users.web, "-s", str(spool), "enqueue", f"echo once >> {out}/ran").stdout.strip()
    assert users.spoolq(users.owner, "-s", str(spool), "work").returncode == 0
    record = spool / "done" / f"{job}.json"
    assert os.stat(record).st_uid == users.owner.uid
    # The record is the owner's: no member may rename it, or write it.
    for attempt in (f"mv {record} {spool}/new/", f"mv {record} {spool}/new/again.json",
                    f"printf x >> {record}", f"rm -f {record}"):
        assert users.sh(users.evil, attempt).returncode != 0, attempt
        assert users.sh(users.web, attempt).returncode != 0, attempt
    # Nor may it read it, to drop a copy.
    for user in (users.evil, users.web):
        assert users.sh(user, f"cp {record} {spool}/drop/.c && mv {spool}/drop/.c {spool}/drop/copy.json").returncode != 0
    assert users.spoolq(users.owner, "-s", str(spool), "work").returncode == 0
    assert (out / "ran").read_text() == "once\n"


def test_a_member_cancels_its_own_waiting_job_and_no_one_elses(users):
    spool = users.shared_spool()
    mine = users.spoolq(users.web, "-s", str(spool), "enqueue", "--in", "1h", "true").stdout.strip()
    theirs = users.spoolq(users.owner, "-s", str(spool), "enqueue", "--in", "1h", "true").stdout.strip()
    with watching(users, spool):
        run = users.spoolq(users.web, "-s", str(spool), "cancel", mine)
        assert (run.returncode, run.stdout) == (0, f"cancelled {mine}\n"), run.stderr
        for user in (users.evil, users.web):
            run = users.spoolq(user, "-s", str(spool), "cancel", theirs)
            assert run.returncode == 1 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert (spool / "new" / f"{theirs}.json").exists()
    assert (spool / "done" / f"{mine}.json").exists()


def test_a_spool_another_user_made_is_refused(users):
    # evil makes a spool where others will look for one: a world-writable
    # folder the owner works in, and a spool it names on the command line.
    public = users.folder("public")
    os.chmod(public, 0o1777)
    out = users.folder("out", owner=users.evil)
    os.chmod(out, 0o777)
    run = users.spoolq(users.evil, "-s", str(public / "spool"), "init", umask="000")
    assert run.returncode == 0, run.stderr
    users.sh(users.evil, f"chmod 755 {public}/spool {public}/spool/*")
    assert _owners_drop(users, users.evil, public / "spool", "trap", {"command": f"id -un > {out}/ran"}).returncode == 0
    error = _one_line_error(users.spoolq(users.owner, "-s", str(public / "spool"), "work"))
    assert f"{public}/spool belongs to sqtevil" in error
    error = _one_line_error(users.spoolq(users.owner, "enqueue", "echo secret", cwd=str(public)))
    assert "belongs to sqtevil" in error
    assert os.listdir(public / "spool" / "new") == ["trap.json"]
    assert not (out / "ran").exists()
    # A shared spool of a group the user is in is a member's to use: it
    # enqueues there, but it runs no worker on it.
    shared = users.folder("evilshared", owner=users.evil) / "spool"
    assert users.spoolq(users.evil, "-s", str(shared), "init", "--group", users.group).returncode == 0
    assert users.spoolq(users.owner, "-s", str(shared), "enqueue", "true").returncode == 0
    assert len(os.listdir(shared / "drop")) == 1  # into the drop, as any member's
    error = _one_line_error(users.spoolq(users.owner, "-s", str(shared), "work"))
    assert "only sqtevil, who owns" in error


def test_an_older_shared_spools_loose_modes_are_refused_until_init_sets_them(users):
    spool = users.shared_spool()
    job = users.spoolq(users.web, "-s", str(spool), "enqueue", "true").stdout.strip()
    for folder in MODES:
        os.chmod(spool / folder, 0o2770)
    os.chmod(spool / "config.json", 0o664)
    fix = f"run 'spoolq -s {spool} init --group {users.group}' as {users.owner.name}"
    for user in (users.owner, users.web):
        error = _one_line_error(users.spoolq(user, "-s", str(spool), "status"))
        assert f"{spool} is writable by its group (mode 2770)" in error and fix in error
    run = users.spoolq(users.owner, "-s", str(spool), "init", "--group", users.group)
    assert run.returncode == 0 and "2750 (it was 2770)" in run.stderr, run.stderr
    for folder, mode in MODES.items():
        assert _mode(spool / folder) == mode, folder
    assert _mode(spool / "config.json") == 0o640
    assert users.spoolq(users.owner, "-s", str(spool), "work").returncode == 0
    assert (spool / "done" / f"{job}.json").exists()


def test_a_private_spool_is_the_owners_alone_under_any_umask(users):
    base = users.folder("private", owner=users.owner)
    for umask in ("000", "022"):
        spool = base / f"spool{umask}"
        assert users.spoolq(users.owner, "-s", str(spool), "init", umask=umask).returncode == 0
        job = users.spoolq(users.owner, "-s", str(spool), "enqueue", "echo secret", umask=umask).stdout.strip()
        assert users.spoolq(users.owner, "-s", str(spool), "config", "set", "fsync", "false", umask=umask).returncode == 0
        assert users.spoolq(users.owner, "-s", str(spool), "work", umask=umask).returncode == 0
        assert users.spoolq(users.owner, "-s", str(spool), "compact", "--keep", "1d", umask=umask).returncode == 0
        for folder in ("", "tmp", "new", "cur", "failed", "dead", "done", "workers"):
            assert _mode(spool / folder) == 0o700, (umask, folder)
        for name in ("config.json", "index.db"):
            assert _mode(spool / name) == 0o600, (umask, name)
        assert users.spoolq(users.web, "-s", str(spool), "show", job).returncode != 0
        assert users.sh(users.web, f"cat {spool}/index.db").returncode != 0


def test_purge_never_copies_another_users_file_linked_into_dead_into_the_index(users):
    spool = users.shared_spool()
    secret = users.folder("secret", owner=users.out) / "secret"
    secret.write_text("the out user's secret\n")
    os.chown(secret, users.out.uid, users.out.gid)
    os.chmod(secret, 0o600)
    # Where fs.protected_hardlinks is 0 a member may link a file it cannot
    # read into dead/; root makes the link here, whatever that setting is.
    os.link(secret, spool / "dead" / "linked.json")
    assert _drop_as(users, users.evil, spool, "evils", {"command": "the untrusted user's bytes"}).returncode == 0
    assert users.spoolq(users.owner, "-s", str(spool), "work").returncode == 0
    for user in (users.owner, None):
        run = users.spoolq(user, "-s", str(spool), "purge", "--dead", "--older-than", "0s", "--yes")
        assert run.returncode == 0, run.stderr
    assert secret.read_text() == "the out user's secret\n" and os.listdir(spool / "dead") == []
    index = (spool / "index.db").read_bytes()
    assert b"secret" not in index and b"untrusted user's bytes" not in index
    run = users.spoolq(users.web, "-s", str(spool), "show", "linked", "--json")
    assert run.returncode == 0 and json.loads(run.stdout)["raw_error"] == "not kept: 2 links", run.stderr


def test_root_making_the_layout_in_a_users_folder_makes_it_that_users_spool(users):
    spool = users.folder("service") / "spool"
    spool.mkdir()
    os.chown(spool, users.owner.uid, users.owner.gid)  # install -d -o owner
    run = users.spoolq(None, "-s", str(spool), "init", "--group", users.group)
    assert run.returncode == 0, run.stderr
    for folder, mode in MODES.items():
        st = os.stat(spool / folder)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, users.owner.uid, users.gid), folder
    assert users.spoolq(users.owner, "-s", str(spool), "config", "set", "trusted_users", users.web.name).returncode == 0
    job = users.spoolq(users.web, "-s", str(spool), "enqueue", "true").stdout.strip()
    run = users.spoolq(users.owner, "-s", str(spool), "work")
    assert run.returncode == 0 and (spool / "done" / f"{job}.json").exists(), run.stderr


def test_a_spool_reached_through_a_folder_or_link_someone_else_could_swap_is_refused(users):
    spool = users.shared_spool()
    evils = users.folder("evils", owner=users.evil)
    # Each through a link of evil's to a spool of its own (root works only on root's).
    for user, target in ((users.owner, spool), (None, users.root_spool())):
        assert users.sh(users.evil, f"ln -sfn {target} {evils}/link").returncode == 0
        error = _one_line_error(users.spoolq(user, "-s", f"{evils}/link", "work", "--max-jobs", "1"))
        assert f"is reached through {evils}" in error and "sqtevil owns" in error, error
    # A folder anyone may write, without the sticky bit, is as bad.
    loose = users.folder("loose")
    os.chmod(loose, 0o777)
    inner = loose / "inner"
    inner.mkdir()
    os.chown(inner, users.owner.uid, users.owner.gid)
    for args in (["init"], ["enqueue", "true"]):
        error = _one_line_error(users.spoolq(users.owner, "-s", str(inner / "spool"), *args))
        # (enqueue makes no spool: a path without one is refused as such)
        assert f"is reached through {loose}, which others can write (mode 777)" in error \
            or (args[0] == "enqueue" and f"{inner / 'spool'} is not a spool" in error), args
        assert os.listdir(inner) == []  # refused before anything was made
    # Through the owner's own folders, or root's, or a sticky one like /tmp, it is fine.
    mine = users.folder("ownerlink", owner=users.owner)
    assert users.sh(users.owner, f"ln -s {spool} {mine}/link").returncode == 0
    run = users.spoolq(users.web, "-s", f"{mine}/link", "status")
    assert run.returncode == 0, run.stderr


def test_folders_and_settings_writable_only_by_a_users_private_group_are_fine(users):
    # Debian and Ubuntu give each user a group of its own and a umask of 002.
    home = users.folder("upg", owner=users.owner)
    project = home / "project"
    assert users.sh(users.owner, f"mkdir {project}", umask="002").returncode == 0
    assert _mode(project) == 0o775 and os.stat(project).st_gid == users.owner.gid
    assert users.spoolq(users.owner, "init", cwd=str(project), umask="002").returncode == 0
    run = users.spoolq(users.owner, "enqueue", "echo private group", cwd=str(project), umask="002")
    assert run.returncode == 0, run.stderr
    assert users.sh(users.owner, "printf '{\"fsync\": false}' > spool/config.json", cwd=str(project),
                    umask="002").returncode == 0
    assert _mode(project / "spool" / "config.json") == 0o664
    run = users.spoolq(users.owner, "work", cwd=str(project), umask="002")
    assert run.returncode == 0 and len(os.listdir(project / "spool" / "done")) == 1, run.stderr
