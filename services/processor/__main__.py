from services.processor.app import register
from yoke.service import run_service

run_service("processor", register)
