"""The commit protocol of one prefix: what makes an epoch exist, who may write, what is kept.

The store (:mod:`.store`: a prefix's layout and node groups), commit records written and
un-committed (:mod:`.commits`), where a prefix is (:mod:`.prefix`), its writer lock
(:mod:`.lock`), retention (:mod:`.retention`) and resuming from an older epoch while newer ones
are committed (:mod:`.staging`).

Imports :mod:`._format` and :mod:`._storage`; runs in the driver's process and needs no session.
The modules of this package import each other (the store commits through :mod:`.commits`, which
asks the prefix's lock before writing): they are one concept and change together.
"""
