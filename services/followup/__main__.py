from services.followup.app import register
from yoke.runtime.service import run_service

run_service("followup", register)
