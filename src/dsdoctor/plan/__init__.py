"""``dsdoctor plan``: memory and speed of each load path for an inference run, and which one to use.
The library function is ``dsdoctor.api.plan`` (= ``dsdoctor.plan.api.plan``)."""
