"""Views of attention heads in a browser: a self-contained offline HTML report and a local Flask app.

>>> from qkcircuits.viz import report_html, write_report, create_app    # doctest: +SKIP
>>> write_report("report.html", report_html(model, scores=qk.scan(model)))   # doctest: +SKIP
>>> create_app(model).run(port=8050)                                     # doctest: +SKIP   (or `qkcircuits serve`)
"""

from ._app import create_app
from ._report import pick_heads, report_html, write_report

__all__ = ["create_app", "pick_heads", "report_html", "write_report"]
