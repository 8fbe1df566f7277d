"""The directory spool: a spool that is a directory of job files, one
folder per state, every move one rename. Its modules own the paths, locks,
syncs and renames (protocol), the moves of a job (transitions), the
recovery of dead workers' jobs (recovery), the workers' registrations
(registry), the SQLite history of compacted jobs (index, compact), a
shared spool's pickup from drop/ (pickup), the folder watcher (watcher),
and the worker's interface to all of it (backend).
"""
