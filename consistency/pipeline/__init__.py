"""The front doors: each command's stages, run in order, above the packages that own them.

``pipeline.compare`` takes a :class:`~consistency.compare.request.CompareRequest` whole and
returns the report, running ``compare`` (numbers) and then ``diagnose`` (words); neither of
those calls back up here. "Pipeline" as in the sequence of stages a request goes through;
pipeline *parallelism* (layer ranges per stage) is ``dump/stages.py``'s business.
"""
