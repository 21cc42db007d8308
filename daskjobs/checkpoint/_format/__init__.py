"""The checkpoint format on paper: what each JSON file and chunk of a prefix means (pure: no I/O).

Node entries and their validation (:mod:`.entries`), commit records and their seal
(:mod:`.records`), node manifests and the summaries a record keeps of them (:mod:`.manifests`),
the raw chunk layout and its XXH3-128 digests (:mod:`.chunks`), JSON blob values
(:mod:`.json_values`) and Caffe2's ``<node>.<epoch>`` names (:mod:`.naming`).

Imports only :mod:`daskjobs.errors`, :mod:`daskjobs._model` and :mod:`daskjobs._version`: everything
read back is validated here before any path is built or byte is decoded.
"""
