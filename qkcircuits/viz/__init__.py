"""Views of attention heads in a browser: a self-contained offline HTML report and a local Flask app.

>>> from qkcircuits.viz import report_html, write_report, create_app
>>> write_report(str(tmp / "report.html"), report_html(model, scores=qk.scan(model, progress=False), progress=False))
>>> (tmp / "report.html").read_text().startswith("<!DOCTYPE html>")
True
>>> create_app(model).test_client().get("/").status_code     # serve it with .run(port=8050) or `qkcircuits serve`
200
"""

from ._app import create_app
from ._report import pick_heads, report_html, write_report

__all__ = ["create_app", "pick_heads", "report_html", "write_report"]
