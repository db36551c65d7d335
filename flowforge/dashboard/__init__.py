"""The web dashboard: HTML pages and their assets, served by the api child.

Pages are static shells (``templates/``) whose scripts (``static/``, plain JavaScript, no
framework and nothing fetched from another origin) read the JSON endpoints under ``/api/v1``
and draw the data. ``graph.py`` lays out a run's DAG for drawing.
"""
