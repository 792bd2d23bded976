"""Measure this machine (``dsdoctor calibrate``) and keep its figures as a machine profile."""
